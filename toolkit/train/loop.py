"""The training loop every image recipe shares: the flags it needs, the optimizer, the epoch loop with
checkpoints, evaluation and records, and the summary. A recipe adds its data and its model.

    >>> cfg = apply_preset(toolkit.parse_config(Config, argv))     # Config(TrainingConfig) + data/model flags
    >>> accelerator, plan = start(cfg)
    >>> model, optimizer, bn_fallback = prepare_model_and_optimizer(model, cfg, accelerator)
    >>> run = make_run(cfg, accelerator, plan, model, optimizer, len(train_loader))
    >>> metrics, records = fit(run, cfg, train_loader, test_loader, bn_fallback)
    >>> summary = finish(run, cfg, records, metrics, extra_field=...)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from toolkit.train.batching import plan_batches
from toolkit.train.checkpoint import CHECKPOINT_FORMATS
from toolkit.engines import ENGINES, build_accelerator
from toolkit import errors
from toolkit.errors import UserError
from toolkit.train.records import RunRecorder, check_fresh_output_dir
from toolkit.train.run_state import RunState, agreed_restart_count, check_loss, peer_failures
from toolkit.train.common import StopRequest, convert_sync_batchnorm, epoch_batches, evaluate
from toolkit.train.common import gather_step_status, warmup_linear_decay


@dataclass
class TrainingConfig:
    # None below: the model's preset (toolkit/train/presets.py, each value with its source).
    global_batch_size: int | None = field(default=None, metadata={"help": "images per optimizer step, all processes; from the preset"})
    micro_batch_size: int | None = field(default=None, metadata={"help": "images per process per forward "
                                         "(caps memory; default: global batch / processes)"})
    lr: float | None = field(default=None, metadata={"help": "peak learning rate (SGD, Nesterov momentum 0.9); "
                             "default: the preset's, scaled linearly with the global batch"})
    weight_decay: float | None = field(default=None, metadata={"help": "L2 penalty on weights; from the preset"})
    warmup: float | None = field(default=None, metadata={"help": "fraction of steps warming up, then linear decay; from the preset"})
    label_smoothing: float | None = field(default=None, metadata={"help": "cross-entropy label smoothing; from the preset"})
    epochs: int | None = field(default=None, metadata={"help": "passes over the training set; from the preset"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    sync_bn: bool = field(default=False, metadata={"help": "synchronise BatchNorm statistics across ranks"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    channels_last: bool = field(default=False, metadata={"help": "NHWC memory format (faster on tensor cores)"})
    checkpoint_every: int = field(default=0, metadata={"help": "optimizer steps between checkpoints (0: epochs)"})
    keep: int = field(default=3, metadata={"help": "checkpoints kept"})
    checkpoint_format: str = field(default="full", metadata={"choices": list(CHECKPOINT_FORMATS), "help": "full: "
                                   "weights gathered into one safetensors file; sharded: each rank writes its own "
                                   "shards (torch.distributed.checkpoint), resumable at any world size"})
    resume: str | None = field(default=None, metadata={"help": "auto (latest in output-dir) or a checkpoint path"})
    seed: int = field(default=0, metadata={"help": "seeds weights, data order and augmentation"})
    eval_every: int = field(default=1, metadata={"help": "epochs between evaluations"})
    engine: str = field(default="auto", metadata={"choices": ["auto", *ENGINES]})
    mixed_precision: str | None = field(default=None, metadata={"choices": ["no", "bf16", "fp16"]})
    timeout: float = field(default=300.0, metadata={"help": "seconds a collective waits for a silent peer"})
    log_with: str | None = field(default=None, metadata={"help": "experiment trackers, comma-separated: tensorboard, "
                                 "trackio, jsonl, csv or all (written to OUTPUT_DIR/logs by the main process)"})
    skip_nonfinite: bool = field(default=False, metadata={"help": "skip steps whose loss is NaN/inf, not stop"})
    debug_nan_step: int | None = field(default=None, metadata={"help": argparse.SUPPRESS})  # tests inject a NaN
    lr_rule: str = field(default="", metadata={"help": argparse.SUPPRESS})  # set by apply_preset


def check_config(cfg):
    for name in ("epochs", "keep", "eval_every"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}.")
    if cfg.max_steps is not None and cfg.max_steps < 1 or cfg.checkpoint_every < 0 or cfg.lr <= 0 or cfg.timeout <= 0:
        raise UserError("--max-steps must be at least 1, --checkpoint-every at least 0, --lr and --timeout positive.")
    if cfg.weight_decay < 0 or not 0 <= cfg.warmup < 1 or not 0 <= cfg.label_smoothing < 1:
        raise UserError("--weight-decay must be at least 0, --warmup and --label-smoothing in [0, 1).")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise UserError(f"--resume {cfg.resume}: that path does not exist; pass a checkpoint folder or 'auto'.")


def start(cfg):
    """(accelerator, batch plan, cfg with the micro-batch as it runs) for a checked, preset-filled config."""
    check_config(cfg)
    log_with = [name.strip() for name in cfg.log_with.split(",")] if cfg.log_with else None
    accelerator = build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision, timeout=cfg.timeout,
                                    log_with=log_with, project_dir=cfg.output_dir)
    check_fresh_output_dir(cfg.output_dir, cfg.resume, agreed_restart_count(accelerator))
    plan = plan_batches(cfg.global_batch_size, accelerator.num_processes, cfg.micro_batch_size)
    accelerator.gradient_accumulation_steps = plan.accumulation
    accelerator.set_seed(cfg.seed)
    return accelerator, plan, replace(cfg, micro_batch_size=plan.micro_batch)  # recorded as it ran


def prepare_model_and_optimizer(model, cfg, accelerator):
    """(prepared model, prepared SGD optimizer, whether BatchNorm statistics are averaged by hand)."""
    model, bn_fallback = convert_sync_batchnorm(model, accelerator) if cfg.sync_bn else (model, False)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.compile:
        model = torch.compile(model)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # no weight decay on biases and norms
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, momentum=0.9, nesterov=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, bn_fallback


def make_run(cfg, accelerator, plan, model, optimizer, batches_per_epoch: int) -> RunState:
    """The run's state with its schedule, restored from --resume (or the latest checkpoint after a restart)."""
    micro_per_epoch = batches_per_epoch // plan.accumulation * plan.accumulation
    total_steps = min(cfg.epochs * micro_per_epoch // plan.accumulation, cfg.max_steps or float("inf"))
    # Stepped by hand once per optimizer step (not prepared: Accelerate would tick it once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(total_steps, cfg.warmup))
    run = RunState(accelerator, model, optimizer, scheduler, plan, total_steps, micro_per_epoch, cfg.output_dir,
                   asdict(cfg), cfg.keep)
    run.restore(cfg.resume)
    return run


def train_epoch(run: RunState, cfg, loader, records, progress, stop: StopRequest) -> bool:
    """Train from (run.epoch, run.batch) to the epoch's end or the last step; True when asked to stop."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    tick, stopping = time.perf_counter(), False  # tick: when this optimizer step began
    step_losses = []  # every rank's loss of each micro-step of this optimizer step
    for batch, (images, labels) in enumerate(epoch_batches(loader, run.epoch, run.batch), run.batch):
        if batch >= run.micro_per_epoch or run.step >= run.total_steps:
            break
        if cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(images), labels, label_smoothing=cfg.label_smoothing)
            if run.step + 1 == cfg.debug_nan_step and accelerator.is_main_process:
                loss = loss * float("nan")
            status = gather_step_status(loss, stop, accelerator)  # on the device: no host sync yet
            if not cfg.skip_nonfinite:  # backward is queued before the sync; a NaN still stops before the step
                accelerator.backward(loss)
            losses, bad_ranks, stopping = check_loss(status, run, cfg.skip_nonfinite)
            if cfg.skip_nonfinite and not bad_ranks:  # which ranks skip must be known before their backward
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step_losses.append(losses)
        if not run.advance(batch):  # a micro-step inside an accumulation
            continue
        run.throughput.step(run.plan.global_batch, time.perf_counter() - tick)
        # The global batch's loss, whatever the split into ranks and micro-steps (equal sizes: drop_last).
        mean_loss, step_losses = torch.cat(step_losses).mean().item(), []
        rate, lr = run.throughput.images_per_s or 0.0, run.scheduler.get_last_lr()[0]
        records.log("step", step=run.step, epoch=run.epoch, loss=mean_loss, lr=lr, images=run.images,
                    images_per_s=round(rate, 1), **({"skipped_ranks": bad_ranks} if bad_ranks else {}))
        accelerator.log({"loss": mean_loss, "lr": lr, "images_per_s": rate}, step=run.step)
        progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.3g}", img_s=f"{rate:.0f}", refresh=False)
        progress.update()
        if stopping or cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
            run.save()
        if stopping:
            break
        tick = time.perf_counter()  # after any checkpoint: saving is not training time
    return stopping


def fit(run: RunState, cfg, train_loader, test_loader, bn_fallback: bool):
    """Epochs until cfg.epochs or run.total_steps, a checkpoint after each and evaluation every cfg.eval_every;
    returns (last test metrics, the open RunRecorder). Ctrl-C/SIGTERM: checkpoint, then exit 130."""
    accelerator, model = run.accelerator, run.model
    records = RunRecorder(cfg.output_dir, active=accelerator.is_main_process)
    accelerator.init_trackers("logs", config=asdict(cfg))  # --log-with's trackers, in OUTPUT_DIR/logs
    progress = tqdm(total=run.total_steps, initial=run.step, disable=not accelerator.is_main_process,
                    dynamic_ncols=True)
    errors.progress_elsewhere = accelerator.num_processes > 1 and not accelerator.is_main_process
    metrics = {}
    run.average_bn = bn_fallback  # at every save, so every evaluation (it follows one) sees the averaged model
    with StopRequest() as stop, peer_failures(run, cfg.timeout):
        try:
            while run.epoch < cfg.epochs and run.step < run.total_steps:
                if train_epoch(run, cfg, train_loader, records, progress, stop):
                    if accelerator.is_local_main_process:  # through tqdm: not glued to the progress bar
                        progress.write(f"interrupted at step {run.step}: checkpoint saved; resume with --resume auto")
                    raise SystemExit(130)
                if run.batch >= run.micro_per_epoch:  # the epoch is complete: the next one starts at its beginning
                    run.epoch, run.batch = run.epoch + 1, 0
                run.save()
                if run.epoch % cfg.eval_every == 0 or run.epoch == cfg.epochs or run.step >= run.total_steps:
                    metrics = evaluate(model, test_loader, accelerator)
                    records.log("epoch", step=run.step, epoch=run.epoch, images=run.images,
                                test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"])
                    accelerator.log({"test_accuracy": metrics["accuracy"], "test_loss": metrics["loss"]}, step=run.step)
                    if accelerator.is_local_main_process:
                        progress.write(f"epoch {run.epoch}: test accuracy {metrics['accuracy']:.4f}")
        finally:
            progress.close()
    if not metrics:  # resumed a finished run: nothing trained, the model still gets its report
        metrics = evaluate(model, test_loader, accelerator)
    return metrics, records


def finish(run: RunState, cfg, records, metrics: dict, **extra) -> dict:
    """Write summary.json (with `extra` fields), print the result and end the engine; returns the summary."""
    accelerator, plan = run.accelerator, run.plan
    summary = records.summary(
        test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"], steps=run.step,
        images_per_s=run.throughput.images_per_s, warmup_s=round(run.throughput.warmup_s, 3),
        warmup_steps=min(run.throughput.steps, run.throughput.warmup_steps), engine=accelerator.name,
        world_size=accelerator.num_processes, global_batch_size=plan.global_batch, micro_batch_size=plan.micro_batch,
        gradient_accumulation=plan.accumulation, mixed_precision=accelerator.mixed_precision,
        skipped_steps=getattr(accelerator, "skipped_steps", 0), **extra, config=asdict(cfg))
    records.close()
    skipped = summary["skipped_steps"]
    accelerator.print(f"done: test accuracy {summary['test_accuracy']}, {summary['images_per_s']} images/s"
                      + (f", {skipped} optimizer step(s) skipped (fp16 overflow or non-finite loss)" if skipped else ""))
    accelerator.end_training()
    return summary
