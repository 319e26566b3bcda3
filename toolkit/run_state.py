"""Where a training run is, how fast it goes, and what stops it cleanly: the plumbing a recipe's loop
needs and should not spell out (checkpoint position, restarts, a non-finite loss, a lost peer).

    >>> run = RunState(accelerator, model, optimizer, scheduler, plan, total_steps, micro_per_epoch,
    ...                output_dir="runs/x", config=asdict(cfg), keep=3)
    >>> run.restore(cfg.resume)           # --resume auto|PATH, or the latest after a torchrun restart
    >>> with peer_failures(run, timeout=300): ...   # a dead rank becomes one sentence
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.batching import BatchPlan
from toolkit.checkpoint import gather_rng_states, latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from toolkit.errors import RunFailure, UserError
from toolkit.records import Throughput
from toolkit.training import (average_batchnorm_stats, is_peer_failure, peer_failure_message, resume_position,
                              step_status)


@dataclass
class RunState:
    """What the loop updates: the objects it trains, where it is, and how fast it went."""

    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: BatchPlan
    total_steps: int  # optimizer steps in the whole run
    micro_per_epoch: int  # micro-steps per epoch, whole optimizer steps only
    output_dir: str
    config: dict  # the resolved configuration, saved with every checkpoint
    keep: int = 3
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # micro-steps of `epoch` done (always a whole number of optimizer steps)
    images: int = 0  # images trained on, all ranks together
    throughput: Throughput = field(default_factory=Throughput)  # images/s after the first steps
    average_bn: bool = False  # --sync-bn's CPU fallback: BatchNorm statistics averaged over ranks at each save

    @property
    def checkpoints(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

    @property
    def images_per_micro_step(self) -> int:
        return self.plan.micro_batch * self.plan.processes

    def advance(self, batch: int) -> bool:
        """Count one micro-step (`batch` of the epoch); True when it completed an optimizer step."""
        self.images += self.images_per_micro_step
        if not self.accelerator.sync_gradients:
            return False
        self.scheduler.step()
        self.step, self.batch = self.step + 1, batch + 1
        return True

    def save(self):
        accelerator = self.accelerator
        if self.average_bn:  # a checkpoint holds the model every rank evaluates, not rank 0's statistics alone
            average_batchnorm_stats(self.model, accelerator)
        # Every rank asks: under fsdp both calls gather the shards of the weights and optimizer state.
        weights, optimizer_state = accelerator.get_state_dict(self.model), self.optimizer.state_dict()
        rng_states = gather_rng_states()  # every rank's own RNG streams (a collective too)
        if accelerator.is_main_process:
            state = {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.batch * self.images_per_micro_step,
                     "world_size": accelerator.num_processes, "engine": accelerator.name, "config": self.config}
            save_checkpoint(self.checkpoints, self.step, model=weights, optimizer=optimizer_state,
                            scheduler=self.scheduler, state=state, keep=self.keep,
                            scaler=getattr(accelerator, "scaler", None), rng_states=rng_states)

    def restore(self, resume: str | None):
        """Continue from `resume` ("auto" or a checkpoint path), or from the latest checkpoint after a
        torchrun/toolkit launch restart; the epoch position maps through samples across world sizes."""
        accelerator = self.accelerator
        restarts = accelerator.env.restart_count
        resume = resume or ("auto" if restarts else None)
        if restarts:
            accelerator.print(f"[toolkit] restart {restarts}: resuming from the latest checkpoint")
        path = latest_checkpoint(self.checkpoints) if resume == "auto" else resume and Path(resume)
        if path is None:
            return
        model, saved_model = self.config["model"], read_state(path)["config"]["model"]
        if saved_model != model:  # checked before loading: other weights would not fit
            raise UserError(f"{path} holds a {saved_model} model, not {model}; pick another --output-dir.")
        state = load_checkpoint(path, model=accelerator.unwrap_model(self.model), optimizer=self.optimizer,
                                scheduler=self.scheduler, scaler=getattr(accelerator, "scaler", None))
        accelerator.print(f"resumed from {path} (step {state['step']})")
        self.step, self.epoch, steps_done = resume_position(state, self.plan.global_batch, accelerator)
        self.batch = steps_done * self.plan.accumulation


def check_loss(loss, run: RunState, stop, skip_nonfinite: bool):
    """(every rank's loss, ranks whose loss is not finite, whether to stop), the same on every rank; a
    non-finite loss stops the run in one sentence unless `skip_nonfinite`."""
    losses, bad_ranks, stopping = step_status(loss, stop, run.accelerator)
    if bad_ranks and not skip_nonfinite:
        raise RunFailure(f"the loss is not finite at step {run.step + 1} on rank(s) {bad_ranks}; stopped with the "
                         f"checkpoints of step {run.step} and before intact (--skip-nonfinite skips such steps).")
    return losses, bad_ranks, stopping


@contextlib.contextmanager
def peer_failures(run: RunState, timeout: float):
    """Turn the error a collective raises when another rank died into one sentence (exit 1)."""
    try:
        yield
    except Exception as error:
        if is_peer_failure(error):
            raise RunFailure(peer_failure_message(error, run.accelerator, run.step, timeout)) from None
        raise
