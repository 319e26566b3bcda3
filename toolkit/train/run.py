"""Where a training run stands and what it writes: the part a recipe's loop calls between optimizer steps.

    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader))
    accelerator.register_for_checkpointing(scheduler, run)      # its position is saved with every save_state
    if (folder := run.resume_folder()) is not None:
        accelerator.load_state(folder)
    for epoch in run.epochs():
        for batch in run.batches(train_loader):                 # mid-epoch after a resume, whole steps only
            ...                                                 # accumulate, backward, step
            if accelerator.sync_gradients:
                accelerator.log(run.step_done(lr=lr, **guard.step_done()), step=run.step)

The position is kept in samples: a checkpoint from 2 processes resumes on 1 (or 8) at the same sample. The
records (steps.csv, epochs.csv, metrics.jsonl, summary.json, the progress bar) are the main process's alone.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.errors import UserError, install_excepthook
from toolkit.train.checkpoint import (checkpoint_folder, finish_checkpoint, latest_checkpoint, load_checkpoint,
                                      read_state)
from toolkit.train.data_position import epoch_batches, resume_position
from toolkit.train.records import RunRecorder, Throughput, check_fresh_output_dir

# What a resume reads from state.json: key -> (type, what it must be).
STATE_KEYS = {"step": (int, "a whole number"), "epoch": (int, "a whole number"),
              "samples_in_epoch": (int, "a whole number"), "config": (dict, "an object")}


class TrainingRun:
    """The run's schedule (optimizer steps per epoch and in all), its position (step, epoch, micro-batches of the
    epoch done), its records and its checkpoints' names. Registered for checkpointing, it saves its position and
    the resolved config (`state_dict`, also merged into state.json) and restores it (`load_state_dict`)."""

    def __init__(self, accelerator, cfg, plan, batches_per_epoch: int, unit: str = "images"):
        self.accelerator, self.cfg, self.plan, self.env = accelerator, cfg, plan, accelerator.env
        self.unit = unit  # what a sample is, in what the run prints (the records' columns say images)
        self.restarts = agreed_restart_count(accelerator)
        check_fresh_output_dir(cfg.output_dir, cfg.resume, self.restarts, parity=self.env.parity_dir is not None)
        accelerator.wait_for_everyone()  # every rank has looked before the main process writes there
        self.micro_per_epoch = batches_per_epoch // plan.accumulation * plan.accumulation  # whole steps only
        if self.micro_per_epoch == 0:
            raise UserError(f"one epoch holds {batches_per_epoch} micro-batches per process, fewer than the "
                            f"{plan.accumulation} of one optimizer step; lower --global-batch-size.")
        self.steps_per_epoch = self.micro_per_epoch // plan.accumulation
        self.total_steps = min(cfg.epochs * self.steps_per_epoch, cfg.max_steps or cfg.epochs * self.steps_per_epoch)
        # The resolved config, as it ran (the micro-batch the plan chose): saved with every checkpoint and in
        # summary.json; a recipe may add to it.
        self.config = {**asdict(cfg), "micro_batch_size": plan.micro_batch}
        self.step = self.epoch = self.batch = 0  # batch: micro-batches of `epoch` done, whole optimizer steps
        self.throughput = Throughput()
        self.records = RunRecorder(cfg.output_dir, active=accelerator.is_main_process)
        self._progress = self._tick = self._resumed_from = None

    @property
    def checkpoints(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    @property
    def images(self) -> int:
        return self.step * self.plan.global_batch

    # -- the loop ------------------------------------------------------------------------------------------
    def epochs(self):
        """The epochs left: from the resumed one until --epochs or the run's last step."""
        while self.epoch < self.cfg.epochs and self.step < self.total_steps:
            yield self.epoch

    def batches(self, loader):
        """This epoch's micro-batches from where the run stands (a mid-epoch resume jumps there), stopping at
        the epoch's last whole optimizer step or the run's last step."""
        if self._progress is None:
            if self.accelerator.num_processes > 1 and not self.accelerator.is_main_process:
                install_excepthook(own_line=True)  # the main process's progress bar may now be on the terminal
            self._progress = tqdm(total=self.total_steps, initial=self.step, dynamic_ncols=True,
                                  disable=not self.accelerator.is_main_process)
        self._tick, epoch = time.perf_counter(), self.epoch
        for batch, item in enumerate(epoch_batches(loader, epoch, self.batch), self.batch):
            if batch >= self.micro_per_epoch or self.step >= self.total_steps or self.epoch != epoch:
                break
            yield item

    def step_done(self, loss: float, lr: float, **values) -> dict:
        """Count the optimizer step just taken, write its row (and `values`) to the records; returns what the
        trackers take (`accelerator.log(..., step=run.step)`)."""
        self.step, self.batch = self.step + 1, self.batch + self.plan.accumulation
        if self.batch >= self.micro_per_epoch:  # the epoch is complete: the next starts at its beginning
            self.epoch, self.batch = self.epoch + 1, 0
        now = time.perf_counter()
        self.throughput.step(self.plan.global_batch, now - self._tick)
        self._tick = now
        rate = self.throughput.images_per_s or 0.0
        self.records.log("step", step=self.step, epoch=self.epoch, loss=loss, lr=lr, images=self.images,
                         images_per_s=round(rate, 1), **values)
        self._progress.set_postfix({"loss": f"{loss:.3f}", "lr": f"{lr:.3g}", f"{self.unit}/s": f"{rate:.0f}"},
                                   refresh=False)
        self._progress.update()
        return {"loss": loss, "lr": lr, "images_per_s": rate}

    def checkpoint_due(self) -> bool:
        return bool(self.cfg.checkpoint_every) and self.step % self.cfg.checkpoint_every == 0

    def evaluation_due(self) -> bool:
        """After an epoch: every --eval-every epochs, and at the end."""
        return self.epoch % self.cfg.eval_every == 0 or self.epoch >= self.cfg.epochs or self.step >= self.total_steps

    def evaluated(self, metrics: dict) -> dict:
        """Record a test evaluation (`evaluate`'s dict); returns what the trackers take."""
        self.records.log("epoch", step=self.step, epoch=self.epoch, images=self.images,
                         test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"])
        self.say(f"epoch {self.epoch}: test accuracy {metrics['accuracy']:.4f}")
        return {"test_accuracy": metrics["accuracy"], "test_loss": metrics["loss"]}

    def say(self, line: str):
        """One line from the main process, through tqdm so it is not glued to the progress bar."""
        if self.accelerator.is_main_process:
            (self._progress or tqdm).write(line)

    def close_progress(self):
        if self._progress is not None:
            self._progress.close()

    # -- checkpoints ---------------------------------------------------------------------------------------
    def checkpoint_folder(self) -> Path:
        """Where `accelerator.save_state` writes this step's checkpoint: OUTPUT_DIR/checkpoints/step-N."""
        self._saving_at = time.perf_counter()
        return checkpoint_folder(self.checkpoints, self.step)

    def checkpoint_saved(self, folder):
        """After `accelerator.save_state(run.checkpoint_folder())` on every rank: `latest` names it and the oldest
        beyond --keep are removed (main process); the save's time is not counted as training time."""
        if self.accelerator.is_main_process:
            finish_checkpoint(self.checkpoints, Path(folder), self.cfg.keep)
        if self._tick is not None:
            self._tick += time.perf_counter() - self._saving_at

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.batch * self.plan.micro_batch *
                self.plan.processes, "world_size": self.accelerator.num_processes, "engine": self.accelerator.name,
                "config": self.config}

    state_json = state_dict  # the toolkit's save_state merges it into state.json, where people and tools read it

    def load_state_dict(self, state: dict):
        self.step, self.epoch, steps_done = resume_position(state, self.plan.global_batch, self.accelerator)
        self.batch = steps_done * self.plan.accumulation
        self.accelerator.print(f"resumed from {self._resumed_from} (step {self.step})")

    def resume_folder(self) -> Path | None:
        """The checkpoint to pass to `accelerator.load_state`: --resume PATH, --resume auto (the latest in
        OUTPUT_DIR/checkpoints), or the latest after a torchrun/toolkit launch restart; None to start afresh.
        Its state.json is checked first (one sentence per defect; another model's weights are refused before
        loading). A folder saved without this run's position (a plain `accelerator.save_state`, or
        `save_checkpoint`) is loaded here: the position follows from its state.json or its schedule's count."""
        resume = self.cfg.resume or ("auto" if self.restarts else None)
        if self.restarts:
            self.accelerator.print(f"[toolkit] restart {self.restarts}: resuming from the latest checkpoint")
        path = latest_checkpoint(self.checkpoints) if resume == "auto" else resume and Path(resume)
        if path is None:
            return None
        saved = read_state(path)
        if saved and ("config" in saved or "samples_in_epoch" in saved):
            saved_model = check_run_state(saved, path)["config"]["model"]
            if saved_model != self.cfg.model:  # checked before loading: other weights would not fit
                raise UserError(f"{path} holds a {saved_model} model, not {self.cfg.model}; pick another --output-dir.")
        self._resumed_from = path
        if (Path(path) / f"custom_checkpoint_{len(self.accelerator._custom_objects) - 1}.pkl").is_file():
            return Path(path)
        self._load_outside_save_state(Path(path), saved)
        return None

    def _load_outside_save_state(self, path: Path, saved: dict):
        accelerator = self.accelerator
        model, optimizer = accelerator._models[0], accelerator._optimizers[0]
        scheduler = next(iter(accelerator._custom_objects), None)
        schedule_file = next((f for f in ("scheduler.bin", "custom_checkpoint_0.pkl") if (path / f).is_file()), None)
        try:
            load_checkpoint(path, model=accelerator.unwrap_model(model), optimizer=optimizer,
                            scaler=getattr(accelerator, "scaler", None))
            if scheduler is not None and schedule_file:
                from toolkit.engines.state_files import load_safe

                scheduler.load_state_dict(load_safe(path / schedule_file))
        except ValueError as error:  # torch's optimizer/scheduler refusal: another optimizer's state
            raise UserError(f"{path} holds an optimizer or scheduler state this recipe's cannot take ({error}); "
                            f"resume from a checkpoint of this recipe or start in a fresh --output-dir.") from None
        if "samples_in_epoch" in saved:
            self.load_state_dict(saved)
            return
        self.step = scheduler.last_epoch if scheduler is not None and schedule_file else 0
        self.epoch, steps_done = divmod(self.step, self.steps_per_epoch)
        self.batch = steps_done * self.plan.accumulation
        accelerator.print(f"resumed from {path}, a save_state folder without the recipe's position: step {self.step} "
                          f"(its schedule's count), epoch {self.epoch}")

    # -- the end -------------------------------------------------------------------------------------------
    def finish(self, metrics: dict, **extra) -> dict:
        """Write summary.json (the run's figures, `extra`, the config) and print the result; returns it."""
        accelerator, plan, meter = self.accelerator, self.plan, self.throughput
        summary = self.records.summary(
            test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"], steps=self.step,
            images_per_s=meter.images_per_s, warmup_s=round(meter.warmup_s, 3),
            warmup_steps=min(meter.steps, meter.warmup_steps), engine=accelerator.name,
            world_size=accelerator.num_processes, global_batch_size=plan.global_batch, micro_batch_size=plan.micro_batch,
            gradient_accumulation=plan.accumulation, mixed_precision=accelerator.mixed_precision,
            skipped_steps=getattr(accelerator, "skipped_steps", 0), **extra, config=self.config)
        self.records.close()
        skipped = summary["skipped_steps"]
        accelerator.print(f"done: test accuracy {summary['test_accuracy']}, {summary['images_per_s']} {self.unit}/s"
                          + (f", {skipped} optimizer step(s) skipped (fp16 overflow or non-finite loss)" if skipped else ""))
        return summary


def agreed_restart_count(accelerator) -> int:
    """How often torchrun (or toolkit launch) restarted the job, the same on every rank: the highest count any
    rank was started with (a node whose own workers did not fail re-joins with its count unchanged)."""
    counts = accelerator.gather(torch.tensor([accelerator.env.restart_count], device=accelerator.device))
    return int(counts.max())


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
