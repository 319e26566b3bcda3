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

from toolkit.train.batching import BatchPlan
from toolkit.train.checkpoint import gather_rng_states, latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from toolkit.errors import RunFailure, UserError
from toolkit.train.records import Throughput
from toolkit.train.common import (average_batchnorm_stats, is_peer_failure, peer_failure_message, read_step_status,
                                  resume_position)


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
        accelerator, scaler = self.accelerator, getattr(self.accelerator, "scaler", None)
        if self.average_bn:  # a checkpoint holds the model every rank evaluates, not rank 0's statistics alone
            average_batchnorm_stats(self.model, accelerator)
        sharded = self.config.get("checkpoint_format") == "sharded"
        if not sharded:  # every rank asks: under fsdp both calls gather the shards of weights and optimizer state
            weights, optimizer_state = accelerator.get_state_dict(self.model), self.optimizer.state_dict()
        rng_states = gather_rng_states()  # every rank's own RNG streams (a collective too)
        state = {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.batch * self.images_per_micro_step,
                 "world_size": accelerator.num_processes, "engine": accelerator.name, "config": self.config}
        if sharded:  # every rank writes its own shards: nothing is gathered
            from toolkit.train.sharded_checkpoint import save_sharded_checkpoint

            save_sharded_checkpoint(self.checkpoints, self.step, model=accelerator.unwrap_model(self.model),
                                    optimizer=self.optimizer, scheduler=self.scheduler, scaler=scaler, state=state,
                                    keep=self.keep, rng_states=rng_states)
        elif accelerator.is_main_process:
            save_checkpoint(self.checkpoints, self.step, model=weights, optimizer=optimizer_state,
                            scheduler=self.scheduler, state=state, keep=self.keep, scaler=scaler, rng_states=rng_states)

    def restore(self, resume: str | None):
        """Continue from `resume` ("auto" or a checkpoint path), or from the latest checkpoint after a
        torchrun/toolkit launch restart; the epoch position maps through samples across world sizes."""
        accelerator = self.accelerator
        restarts = agreed_restart_count(accelerator)
        resume = resume or ("auto" if restarts else None)
        if restarts:
            accelerator.print(f"[toolkit] restart {restarts}: resuming from the latest checkpoint")
        path = latest_checkpoint(self.checkpoints) if resume == "auto" else resume and Path(resume)
        if path is None:
            return
        saved = read_state(path)
        if not saved or "config" not in saved and "samples_in_epoch" not in saved:
            self._restore_accelerate_folder(path)
            return
        model, saved_model = self.config["model"], check_run_state(saved, path)["config"]["model"]
        if saved_model != model:  # checked before loading: other weights would not fit
            raise UserError(f"{path} holds a {saved_model} model, not {model}; pick another --output-dir.")
        state = load_checkpoint(path, model=accelerator.unwrap_model(self.model), optimizer=self.optimizer,
                                scheduler=self.scheduler, scaler=getattr(accelerator, "scaler", None))
        accelerator.print(f"resumed from {path} (step {state['step']})")
        self.step, self.epoch, steps_done = resume_position(state, self.plan.global_batch, accelerator)
        self.batch = steps_done * self.plan.accumulation


    def _restore_accelerate_folder(self, path):
        """A folder `accelerator.save_state` wrote outside the recipes (no recipe position in it): its weights,
        optimizer and schedule, with the position taken from the schedule's step count."""
        accelerator = self.accelerator
        has_schedule = (Path(path) / "scheduler.bin").is_file()
        try:
            load_checkpoint(path, model=accelerator.unwrap_model(self.model), optimizer=self.optimizer,
                            scheduler=self.scheduler if has_schedule else None,
                            scaler=getattr(accelerator, "scaler", None))
        except ValueError as error:  # torch's optimizer/scheduler refusal: another optimizer's state
            raise UserError(f"{path} holds an optimizer or scheduler state this recipe's cannot take ({error}); "
                            f"resume from a checkpoint of this recipe or start in a fresh --output-dir.") from None
        self.step = self.scheduler.last_epoch if has_schedule else 0
        steps_per_epoch = self.micro_per_epoch // self.plan.accumulation
        self.epoch, steps_done = divmod(self.step, steps_per_epoch)
        self.batch = steps_done * self.plan.accumulation
        accelerator.print(f"resumed from {path}, a save_state folder without the recipe's position: step {self.step} "
                          f"(its schedule's count), epoch {self.epoch}")


def agreed_restart_count(accelerator) -> int:
    """How often torchrun (or toolkit launch) restarted the job, the same on every rank: the highest count
    any rank was started with. A node whose own workers did not fail re-joins a new rendezvous round with
    its count unchanged (0 the first time), yet it must resume with the others (a collective)."""
    counts = accelerator.gather(torch.tensor([accelerator.env.restart_count], device=accelerator.device))
    return int(counts.max())


# What RunState.save writes into state.json and a resume reads back: key -> (type, what it must be).
STATE_KEYS = {"step": (int, "a whole number"), "epoch": (int, "a whole number"),
              "samples_in_epoch": (int, "a whole number"), "config": (dict, "an object")}


def check_run_state(state: dict, path) -> dict:
    """`state` (a checkpoint's state.json) if it holds what a resume reads; else one sentence naming the file
    and the key, instead of a KeyError half-way through restoring."""
    file = Path(path) / "state.json"
    file = file if file.is_file() else f"the state.json of the latest checkpoint under {path}"
    fix = "resume from another checkpoint or start in a fresh --output-dir."
    for key, (kind, what) in STATE_KEYS.items():
        if key not in state:
            raise UserError(f"{file} has no {key!r}, which a resume needs; {fix}")
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool) or kind is int and value < 0:
            raise UserError(f"{file} holds {key!r} = {value!r}, not {what}; {fix}")
    if not isinstance(state["config"].get("model"), str):
        raise UserError(f"{file} names no model in 'config' (it holds {state['config'].get('model')!r}); {fix}")
    return state


def check_loss(status, run: RunState, skip_nonfinite: bool):
    """(every rank's loss, ranks whose loss is not finite, whether to stop) from `gather_step_status`, the same
    on every rank; a non-finite loss stops the run in one sentence unless `skip_nonfinite`."""
    losses, bad_ranks, stopping = read_step_status(status)
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
