"""Where a training run stands and what it writes: the part a recipe's loop calls between optimizer steps.

    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader))
    checkpointed = [scheduler, run]                             # its position is saved with every save_state
    accelerator.register_for_checkpointing(*checkpointed)
    if (resume := run.resume_folder(model, optimizer, checkpointed)).action == "load_state":
        accelerator.load_state(resume.folder)
    for epoch in run.epochs():
        for batch in run.batches(train_loader):                 # mid-epoch after a resume, whole steps only
            ...                                                 # accumulate, backward, step
            if accelerator.sync_gradients:
                accelerator.log(run.step_done(lr=lr, **guard.step_done()), step=run.step)

The position is kept in samples: a checkpoint from 2 processes resumes on 1 (or 8) at the same sample. The
records (steps.csv, epochs.csv, metrics.jsonl, summary.json, the progress bar) are the main process's alone.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from toolkit.engines import engine_name, mesh_sizes
from toolkit.errors import UserError, install_excepthook
from toolkit.launch.env import read_launch_env
from toolkit.train.attempts import agreed_restart_count, overall_rate, world_change_line, world_changes
from toolkit.train.best import BestCheckpoint
from toolkit.checkpoint.functional import (check_run_state, checkpoint_folder, finish_checkpoint, latest_checkpoint,
                                           read_state, seal_if_unsealed)
from toolkit.checkpoint.state import holds_registered
from toolkit.train.config_changes import config_changes
from toolkit.train.confusion import ConfusionPicture
from toolkit.train.cost import StepCost, mfu, peak_flops, peak_memory_bytes, peak_range, seconds_since_process_start
from toolkit.train.data_position import epoch_batches, resume_position
from toolkit.train.divergence import DivergenceWatch
from toolkit.train.plan_check import PlanCheck
from toolkit.train.profiling import StepProfiler
from toolkit.train.ray_report import report_checkpoint, report_summary
from toolkit.train.records import RunRecorder, Throughput, average_figures, check_fresh_output_dir
from toolkit.train.resume import Resume, load_weights_and_schedule, schedule_among


class TrainingRun:
    """The run's schedule (optimizer steps per epoch and in all), its position (step, epoch, micro-batches of the
    epoch done), its records and its checkpoints' names. Registered for checkpointing, it saves its position and
    the resolved config (`state_dict`, also merged into state.json) and restores it (`load_state_dict`)."""

    def __init__(self, accelerator, cfg, plan, batches_per_epoch: int, unit: str = "images",
                 flops_per_sample: int | None = None, forecast=None):
        self.accelerator, self.cfg, self.plan, self.env = accelerator, cfg, plan, read_launch_env()
        self.unit = unit  # what a sample is, in what the run prints (the records' columns say images)
        self.restarts = agreed_restart_count(accelerator, self.env.restart_count)
        check_fresh_output_dir(cfg.output_dir, cfg.resume, self.restarts, parity=self.env.parity_dir is not None)
        accelerator.wait_for_everyone()  # every rank has looked before the main process writes there
        self.micro_per_epoch = batches_per_epoch // plan.accumulation * plan.accumulation  # whole steps only
        if self.micro_per_epoch == 0:
            raise UserError(f"one epoch holds {batches_per_epoch} micro-batches per process, fewer than the "
                            f"{plan.accumulation} of one optimizer step; lower --global-batch-size.")
        self.steps_per_epoch = self.micro_per_epoch // plan.accumulation
        self.total_steps = min(cfg.epochs * self.steps_per_epoch, cfg.max_steps or cfg.epochs * self.steps_per_epoch)
        # The resolved config, as it ran (the micro-batch the plan chose): saved with every checkpoint, in
        # summary.json, and as the flags in config.yaml once training starts (--config reads it back).
        self.config = {**asdict(cfg), "micro_batch_size": plan.micro_batch, "mixed_precision": accelerator.mixed_precision}
        self.step = self.epoch = self.batch = 0  # batch: micro-batches of `epoch` done, whole optimizer steps
        self.throughput = Throughput()
        self.cost = StepCost(accelerator.device)  # where the time goes: data wait, compute, checkpoint saving
        self.time_to_first_step_s = self.first_step_at = None  # first_step_at: this attempt's, Unix time
        # For MFU: one sample's forward and backward FLOPs (cost.flops_per_sample) and one device's peak FLOP/s.
        self.flops_per_sample = flops_per_sample
        self.peak_flops = peak_flops(accelerator.device, accelerator.mixed_precision, getattr(cfg, "peak_tflops", None))
        self.profiler = StepProfiler(getattr(cfg, "profile_steps", None), Path(cfg.output_dir) / "profile",
                                     accelerator.process_index, accelerator.is_main_process, self.say)
        self.records = RunRecorder(cfg.output_dir, active=accelerator.is_main_process)
        self.picture = ConfusionPicture(self.records.dir / "confusion.png")  # drawn by the main process alone
        # Earlier attempts (a resume's history, as of the checkpoint it resumed from), and where this one began.
        self.attempts, self.first_step = [], 0
        self.finished = None  # a --resume of a run that had ended: its summary.json, which stands
        self._progress = self._tick = self._resumed_from = None
        self.keeper = BestCheckpoint(cfg.keep_best, self.checkpoints, cfg.keep, accelerator.is_main_process, self.say)
        self.peak_memory = None  # (least, most) over ranks, at the last evaluation
        self.plan_check = PlanCheck(forecast, accelerator, compiled=bool(getattr(cfg, "compile", False)))
        # Loud warnings for a run that trains to nothing with exit 0: a schedule too short for the full lr (said
        # by `run.divergence.started(classes)`), evaluations that diverge or stay at chance; `warnings` holds them.
        self.divergence = DivergenceWatch(self.total_steps, cfg.lr, plan.global_batch, cfg.warmup, say=self.say,
                                          check_schedule=self.total_steps == cfg.epochs * self.steps_per_epoch)
        self.warnings = self.divergence.warnings

    @property
    def checkpoints(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    @property
    def best(self) -> dict | None:
        """--keep-best's best evaluation so far {"metric", "value", "step", "folder"}, kept across a resume."""
        return self.keeper.best

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
        if self._progress is None:  # this attempt trains: config.yaml holds its flags (a finished run's stays)
            self.records.write_config(self.cfg, self.config)
            if self.accelerator.num_processes > 1 and not self.accelerator.is_main_process:
                install_excepthook(own_line=True)  # the main process's progress bar may now be on the terminal
            self._progress = tqdm(total=self.total_steps, initial=self.step, dynamic_ncols=True,
                                  disable=not self.accelerator.is_main_process)
        self.profiler.tick(self.step)  # --profile-steps from the first step: it starts here
        # accumulate()'s micro-step counter, in phase with the position on every rank: load_state restores the
        # checkpoint's count, which another accumulation puts out of phase, and Accelerate restores it only on
        # the ranks that saved one (a grown world's new ranks start at 0: their gradients would sync apart).
        self.accelerator.step = self.batch
        self._tick, epoch = time.perf_counter(), self.epoch
        self.cost.restart()
        fetched = enumerate(epoch_batches(loader, epoch, self.batch), self.batch)
        try:
            while True:
                self.cost.fetching()
                asked = time.perf_counter()
                batch, item = next(fetched, (None, None))
                self.cost.waited(time.perf_counter() - asked)  # the step's data wait: blocked on the loader
                if batch is None or batch >= self.micro_per_epoch or self.step >= self.total_steps or self.epoch != epoch:
                    break
                if batch % self.plan.accumulation == 0:  # a step's first micro-batch: the plan counts the second
                    self.plan_check.step_starts(self.step - self.first_step)
                yield item
        finally:
            self.plan_check.stop()

    def step_done(self, loss: float, lr: float, **values) -> dict:
        """Count the optimizer step just taken, write its row (and `values`) to the records; returns what the
        trackers take (`accelerator.log(..., step=run.step)`)."""
        self.step, self.batch = self.step + 1, self.batch + self.plan.accumulation
        if self.batch >= self.micro_per_epoch:  # the epoch is complete: the next starts at its beginning
            self.epoch, self.batch = self.epoch + 1, 0
        now = time.perf_counter()
        self.throughput.step(self.plan.global_batch, now - self._tick)
        split = self.cost.step(now - self._tick)  # data wait and compute (the step's time without saving)
        self.plan_check.step_done(now - self._tick)
        if self.time_to_first_step_s is None:  # this process's start to its first optimizer step done
            self.time_to_first_step_s, self.first_step_at = seconds_since_process_start(), time.time()
        self.profiler.tick(self.step)  # --profile-steps: starts before step A, writes the traces after step B
        if self.env.debug_step_ms:  # tests' slow steps: outside both steps' measured time
            time.sleep(self.env.debug_step_ms / 1000)
        self._tick = time.perf_counter()
        if self.cost.warning and self.cost.warning not in self.warnings:  # the loader holds training up: once
            self.warnings.append(self.cost.warning)
            self.say(self.cost.warning)
        rate = self.throughput.images_per_s or 0.0
        self.records.log("step", step=self.step, epoch=self.epoch, loss=loss, lr=lr, images=self.images,
                         images_per_s=round(rate, 1), **values, **split)
        self._progress.set_postfix({"loss": f"{loss:.3f}", "lr": f"{lr:.3g}", f"{self.unit}/s": f"{rate:.0f}"},
                                   refresh=False)
        self._progress.update()
        return {"loss": loss, "lr": lr, "images_per_s": rate, **({"grad_norm": values["grad_norm"]}
                                                                 if "grad_norm" in values else {})}

    def checkpoint_due(self) -> bool:
        return bool(self.cfg.checkpoint_every) and self.step % self.cfg.checkpoint_every == 0

    def evaluation_due(self) -> bool:
        """After an epoch: every --eval-every epochs, and at the end."""
        return self.epoch % self.cfg.eval_every == 0 or self.epoch >= self.cfg.epochs or self.step >= self.total_steps

    def evaluated(self, metrics: dict) -> dict:
        """Record a test evaluation (`EvalMetrics.compute()`'s dict) right after this step's checkpoint: its row and
        line, confusion.png and confusion.json when it has a confusion matrix, and under --keep-best whether this
        step's checkpoint is the best. Every rank calls it; returns what the trackers take."""
        epoch, label = self.epochs_done()
        top5 = {"test_top5_accuracy": metrics["top5_accuracy"]} if "top5_accuracy" in metrics else {}
        ema = average_figures(metrics)
        self.records.log("epoch", step=self.step, epoch=epoch, images=self.images, test_accuracy=metrics["accuracy"],
                         **top5, test_loss=metrics["loss"], test_count=metrics["count"], **ema)
        self.say(f"{label}: test accuracy {metrics['accuracy']:.4f}"
                 + (f", top-5 {metrics['top5_accuracy']:.4f}" if top5 else "")
                 + (f"; weight average (--ema-decay) {ema['ema_test_accuracy']:.4f}" if ema else ""))
        self.peak_memory = self.gathered_peak_memory()
        utilisation, (planned, missed) = self.mfu(), self.plan_check.evaluated()
        mesh = mesh_sizes(self.accelerator)
        self.say(f"{label}: {self.cost.report()} of the time since the last evaluation · peak memory "
                 + peak_range(self.peak_memory) + " per rank"
                 + (" on mesh " + " x ".join(f"{dim} {size}" for dim, size in mesh.items()) if mesh else "")
                 + (f" · MFU {utilisation:.0%}" if utilisation is not None else " · MFU unknown") + planned)
        self.say(missed)
        names = self.config.get("classes") or self.config.get("vocabulary")  # images.py's, lm.py's outputs
        self.divergence.check(metrics, final=self.step >= self.total_steps, classes=len(names) if names else None)
        if "confusion_matrix" in metrics and self.accelerator.is_main_process:
            self._write_confusion(metrics)
        if self.cfg.keep_best:
            self.keeper.evaluated(metrics, self.step)
        return {"test_accuracy": metrics["accuracy"], **top5, "test_loss": metrics["loss"], **ema}

    def mfu(self) -> float | None:
        """The model FLOP utilisation so far (the throughput after warm-up), None when a figure is unknown."""
        return mfu(self.flops_per_sample, self.throughput.images_per_s, self.accelerator.num_processes,
                   self.peak_flops)

    def gathered_peak_memory(self) -> tuple[int, int]:
        """(least, most) peak memory of any rank (a collective: every rank calls it)."""
        mine = torch.tensor([peak_memory_bytes(self.accelerator.device)], device=self.accelerator.device)
        every = self.accelerator.gather(mine)
        return int(every.min()), int(every.max())

    def _write_confusion(self, metrics: dict):
        """OUTPUT_DIR/confusion.json, this evaluation's (each evaluation replaces it), and confusion.png when due."""
        matrix, names = metrics["confusion_matrix"], self.config.get("classes")
        names = [str(n) for n in names] if names and len(names) == len(matrix) else [str(i) for i in range(len(matrix))]
        self.picture.update(matrix, names, final=self.step >= self.total_steps)
        self.records.write_json("confusion.json", {"classes": names, "matrix": matrix, "step": self.step,
                                                   "per_class_accuracy": metrics["per_class_accuracy"]})

    def epochs_done(self) -> tuple[float, str]:
        """(epochs done, as the records' `epoch` column counts them; how the run's lines name that point): a run
        --max-steps stopped inside an epoch is a fraction of the way into the next, not at "epoch 0"."""
        if self.batch == 0:
            return self.epoch, f"epoch {self.epoch}"
        done = self.batch / self.micro_per_epoch
        return round(self.epoch + done, 3), f"step {self.step} ({done:.0%} into epoch {self.epoch + 1})"

    def say(self, line: str | None):
        """One line from the main process, through tqdm so it is not glued to the progress bar (None: nothing)."""
        if line is not None and self.accelerator.is_main_process:
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
        self.accelerator.wait_for_everyone()  # every rank's files are written (Accelerate's own save_state seals none)
        if self.accelerator.is_main_process:
            seal_if_unsealed(folder, self.step, self.accelerator.num_processes)
            finish_checkpoint(self.checkpoints, Path(folder), self.cfg.keep)
        report_checkpoint(self, folder)  # under Ray Train: into Ray's storage, which restores it after a failure
        saving = time.perf_counter() - self._saving_at
        self.cost.saved(saving)
        if self._tick is not None:
            self._tick += saving

    def state_dict(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.batch * self.plan.micro_batch *
                self.plan.processes, "world_size": self.accelerator.num_processes, "engine": engine_name(self.accelerator),
                "config": self.config, "attempts": self.attempts + [self.this_attempt()], "best": self.best}

    state_json = state_dict  # the toolkit's save_state merges it into state.json, where people and tools read it

    def load_state_dict(self, state: dict):
        self.step, self.epoch, steps_done = resume_position(state, self.plan.global_batch, self.accelerator)
        self.batch = steps_done * self.plan.accumulation
        attempts = state.get("attempts")
        if isinstance(attempts, list) and all(isinstance(a, dict) and "wall_time_s" in a for a in attempts):
            self.attempts = attempts  # the records' clock goes on from the checkpoint's, as the step does
            self.records.continue_from(sum(a["wall_time_s"] for a in attempts))
        self.first_step = self.step
        self.keeper.resumed(state.get("best"), self.step)
        logged = self.records.last_step()
        redone = f"; {logged - self.step} step(s) after it are done again" if logged and logged > self.step else ""
        self.accelerator.print(f"resumed from {self._resumed_from} (step {self.step}){redone}")
        if self.attempts and self.attempts[-1].get("world_size") != self.accelerator.num_processes:
            self.accelerator.print(world_change_line(self.attempts[-1], self.this_attempt(), self.plan))

    def this_attempt(self) -> dict:
        """This attempt's figures so far: the steps it trained, its wall time and throughput."""
        meter = self.throughput
        return {"from_step": self.first_step, "to_step": self.step, "engine": engine_name(self.accelerator),
                "world_size": self.accelerator.num_processes, "nodes": self.env.num_nodes,
                "accumulation": self.plan.accumulation, "micro_batch": self.plan.micro_batch,
                "images_per_s": meter.images_per_s,
                "warmup_s": round(meter.warmup_s, 3), "wall_time_s": round(time.time() - self.records.opened, 3),
                "first_step_at": self.first_step_at, "warnings": list(self.warnings)}

    def resume_folder(self, model, optimizer, checkpointed) -> Resume:
        """What to resume from, and how: --resume PATH, --resume auto (the latest in OUTPUT_DIR/checkpoints), or
        the latest after a torchrun/toolkit launch restart (`Resume`). `model` and `optimizer` are the prepared
        ones; `checkpointed` the objects registered for checkpointing, in their order, this run among them.
        Its state.json is checked first (one sentence per defect; another model's weights are refused before
        loading). A folder saved without them (a plain `accelerator.save_state`, or `save_checkpoint`) is loaded
        here: the position follows from its state.json or its schedule's count."""
        if not any(o is self for o in checkpointed):
            raise ValueError("register the run for checkpointing (accelerator.register_for_checkpointing) and "
                             "pass what was registered: its position is saved with every save_state")
        resume = self.cfg.resume or ("auto" if self.restarts else None)
        if self.restarts:
            self.accelerator.print(f"[toolkit] restart {self.restarts}: resuming from the latest checkpoint")
        path = latest_checkpoint(self.checkpoints) if resume == "auto" else resume and Path(resume)
        if path is None:
            return Resume("start")
        path, saved = Path(path), read_state(path)
        if saved and ("config" in saved or "samples_in_epoch" in saved):
            saved_model = check_run_state(saved, path)["config"]["model"]
            if saved_model != self.cfg.model:  # checked before loading: other weights would not fit
                raise UserError(f"{path} holds a {saved_model} model, not {self.cfg.model}; pick another --output-dir.")
            self._check_changes(saved["config"], path)
            if self._finished(saved, path):
                return Resume("finished", path)
        self._resumed_from = path
        if holds_registered(path, len(checkpointed)):
            return Resume("load_state", path)
        scheduler = schedule_among(checkpointed)
        scheduled = load_weights_and_schedule(path, self.accelerator, model, optimizer, scheduler)
        if "samples_in_epoch" in saved:
            self.load_state_dict(saved)
            return Resume("loaded", path)
        self.step = scheduler.last_epoch if scheduled else 0
        self.epoch, steps_done = divmod(self.step, self.steps_per_epoch)
        self.batch = steps_done * self.plan.accumulation
        self.accelerator.print(f"resumed from {path}, a save_state folder without the recipe's position: step "
                               f"{self.step} (its schedule's count), epoch {self.epoch}")
        return Resume("loaded", path)

    def _check_changes(self, saved: dict, path: Path):
        """Say every difference from the checkpoint's config in one line; refuse those that change the math
        (one sentence naming them all) unless --allow-config-change."""
        changes = config_changes(saved, self.config)
        refused = [change for change in changes if change.changes_math and not self.cfg.allow_config_change]
        if refused:
            raise UserError(f"resuming {path} would change the training: {'; '.join(map(str, refused))}; pass the "
                            "checkpoint's values, or add --allow-config-change to train on with these.")
        for change in changes:
            allowed = ", allowed by --allow-config-change" if change.changes_math else ""
            self.accelerator.print(f"[toolkit] resume: {change}{allowed}")

    def _finished(self, saved: dict, path: Path) -> bool:
        """True when the checkpoint is this run's end and OUTPUT_DIR/summary.json reports that end: the run is
        done, and the resume only says so (main process)."""
        summary_file = Path(self.cfg.output_dir) / "summary.json"
        if saved["step"] < self.total_steps or not summary_file.is_file():
            return False
        try:
            summary = json.loads(summary_file.read_text())
        except (OSError, ValueError):
            return False  # an unreadable summary is written again, from the checkpoint
        if not isinstance(summary, dict) or summary.get("steps") != saved["step"]:
            return False
        self.finished = summary
        rate = f", {summary['images_per_s']} {self.unit}/s" if summary.get("images_per_s") else ""
        self.accelerator.print(f"{self.cfg.output_dir} already finished at step {saved['step']} (checkpoint {path}): "
                               f"test accuracy {summary.get('test_accuracy', float('nan')):.4f}{rate}; nothing "
                               "trained or rewritten. To train further, raise --epochs and add --allow-config-change.")
        return True

    # -- the end -------------------------------------------------------------------------------------------
    def finish(self, metrics: dict, **extra) -> dict:
        """Write summary.json (the run's figures over every attempt, each attempt's own, `extra`, the config) and
        print the result; returns it."""
        accelerator, plan, meter = self.accelerator, self.plan, self.throughput
        self.profiler.close()
        if accelerator.is_main_process:
            self.picture.flush()  # the last evaluation's matrix, in a run stopped before its final one
        attempts = self.attempts + [self.this_attempt()]
        by_class = {f"test_{key}": metrics[key] for key in ("top5_accuracy", "per_class_accuracy", "confusion_matrix")
                    if key in metrics}
        summary = self.records.summary(
            test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"], **by_class,
            **average_figures(metrics), **({"best_checkpoint": self.best} if self.best else {}), steps=self.step,
            time_split_s={part: round(seconds, 3) for part, seconds in self.cost.totals.items()},
            peak_memory_bytes=dict(zip(("min_rank", "max_rank"), self.peak_memory or self.gathered_peak_memory())),
            flops_per_sample=self.flops_per_sample, mfu=self.mfu(),
            time_to_first_step_s=self.time_to_first_step_s and round(self.time_to_first_step_s, 3),
            images_per_s=overall_rate(attempts, plan.global_batch), warmup_s=round(sum(a["warmup_s"] for a in attempts), 3),
            warmup_steps=min(meter.steps, meter.warmup_steps), engine=engine_name(accelerator),
            wall_time_s=round(sum(a["wall_time_s"] for a in attempts), 3), attempts=attempts,
            world_changes=world_changes(attempts),
            world_size=accelerator.num_processes, mesh=mesh_sizes(accelerator), global_batch_size=plan.global_batch,
            micro_batch_size=plan.micro_batch, plan=self.plan_check.summary(),
            gradient_accumulation=plan.accumulation, mixed_precision=accelerator.mixed_precision,
            skipped_steps=getattr(accelerator, "skipped_steps", 0),
            warnings=list(dict.fromkeys(line for a in attempts for line in a.get("warnings", []))), **extra,
            config=self.config)
        self.records.close()
        report_summary(self, summary)
        skipped, rate = summary["skipped_steps"], summary["images_per_s"]
        accelerator.print(f"done: test accuracy {summary['test_accuracy']:.4f}"
                          + (f", {rate} {self.unit}/s" if rate is not None else "")
                          + (f" over {len(attempts)} attempts" if len(attempts) > 1 else "")
                          + (f", {skipped} optimizer step(s) skipped (fp16 overflow or non-finite loss)" if skipped else ""))
        return summary

