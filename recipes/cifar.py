"""Train a ResNet on CIFAR-10/100 with the Accelerator API: one script from one CPU to many GPUs on many nodes.

    python recipes/cifar.py --dataset synthetic --model tiny --epochs 2          # one process
    accelerate launch recipes/cifar.py                                           # accelerate's default config
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar.py --dataset synthetic
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/cifar.py
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/cifar.py
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank R recipes/cifar.py
    torchrun --nproc_per_node 2 recipes/cifar.py --engine ddp
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml --engine ddp recipes/cifar.py
    python recipes/cifar.py --engine dp                                          # nn.DataParallel

The engine (accelerate, ddp, dp, single) follows from the launcher; nothing below asks which one runs.
--batch-size is per process and per micro-step; the global batch is batch-size x processes x grad-accum.
Mixed precision comes from the accelerate profile unless --mixed-precision is given.
"""

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import toolkit
from toolkit.checkpoint import gather_rng_states, latest_checkpoint, load_checkpoint, save_checkpoint
from toolkit.data import MemoryLoader, build_torch_loader, load_data
from toolkit.errors import RunFailure, UserError
from toolkit.models import MODELS, build_model
from toolkit.records import RunRecorder
from toolkit.training import (StopRequest, average_batchnorm_stats, convert_sync_batchnorm, epoch_batches,
                              evaluate, is_peer_failure, peer_failure_message, resume_position, step_status,
                              warmup_linear_decay)


@dataclass
class Config:
    dataset: str = field(default="cifar10", metadata={"help": "cifar10, cifar100, synthetic or hf:NAME_OR_PATH"})
    data_dir: str = field(default="data", metadata={"help": "folder holding (or receiving) the dataset"})
    model: str = field(default="resnet18", metadata={"choices": sorted(MODELS)})
    epochs: int = field(default=10, metadata={"help": "passes over the training set"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    batch_size: int = field(default=128, metadata={"help": "images per process per micro-step"})
    lr: float = field(default=0.2, metadata={"help": "peak learning rate (SGD, Nesterov momentum 0.9)"})
    weight_decay: float = field(default=5e-4, metadata={"help": "L2 penalty per step"})
    grad_accum: int = field(default=1, metadata={"help": "micro-steps per optimizer step"})
    sync_bn: bool = field(default=False, metadata={"help": "synchronise BatchNorm statistics across ranks"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    channels_last: bool = field(default=False, metadata={"help": "NHWC memory format (faster on tensor cores)"})
    loader: str = field(default="memory", metadata={"choices": ["memory", "torch"]})
    output_dir: str = field(default="runs/cifar", metadata={"help": "checkpoints, metrics and summary.json"})
    checkpoint_every: int = field(default=0, metadata={"help": "optimizer steps between checkpoints (0: epochs)"})
    keep: int = field(default=3, metadata={"help": "checkpoints kept"})
    resume: str | None = field(default=None, metadata={"help": "auto (latest in output-dir) or a checkpoint path"})
    seed: int = field(default=0, metadata={"help": "seeds weights, data order and augmentation"})
    eval_every: int = field(default=1, metadata={"help": "epochs between evaluations"})
    engine: str = field(default="auto", metadata={"choices": ["auto", *toolkit.ENGINES]})
    mixed_precision: str | None = field(default=None, metadata={"choices": ["no", "bf16", "fp16"]})
    timeout: float = field(default=300.0, metadata={"help": "seconds a collective waits for a silent peer"})
    skip_nonfinite: bool = field(default=False, metadata={"help": "skip steps whose loss is NaN/inf, not stop"})
    debug_nan_step: int | None = field(default=None, metadata={"help": argparse.SUPPRESS})  # tests inject a NaN


def check_config(cfg: Config):
    for name in ("epochs", "batch_size", "grad_accum", "keep", "eval_every"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}.")
    if cfg.max_steps is not None and cfg.max_steps < 1 or cfg.checkpoint_every < 0 or cfg.lr <= 0 or cfg.timeout <= 0:
        raise UserError("--max-steps must be at least 1, --checkpoint-every at least 0, --lr and --timeout positive.")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise UserError(f"--resume {cfg.resume}: that path does not exist; pass a checkpoint folder or 'auto'.")


def build_loaders(cfg, data, accelerator):
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    # Evaluation: disjoint shards per rank, summed once at the end (exact for any world or batch size).
    test = MemoryLoader(data.test_x, data.test_y, cfg.batch_size, rank=rank, world_size=world, train=False,
                        device=device)
    if cfg.loader == "memory":
        train = MemoryLoader(data.train_x, data.train_y, cfg.batch_size, rank=rank, world_size=world,
                             seed=cfg.seed, device=device)
    else:
        train = accelerator.prepare(build_torch_loader(data.train_x, data.train_y, cfg.batch_size, train=True,
                                                       seed=cfg.seed))
    return train, test


def build_model_and_optimizer(cfg, num_classes, accelerator):
    model = build_model(cfg.model, num_classes)
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


@dataclass
class Run:
    """What the loop updates: the objects it trains, where it is, and how fast it went."""

    cfg: Config
    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    samples_per_batch: int  # images in one micro-step over all ranks
    micro_per_epoch: int  # micro-steps per epoch, whole optimizer steps only
    total_steps: int  # optimizer steps in the whole run
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batch: int = 0  # micro-steps of `epoch` done (always a whole number of optimizer steps)
    images: int = 0
    seconds: float = 0.0

    @property
    def checkpoints(self) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints"

    def save(self):
        rng_states = gather_rng_states()  # every rank's own RNG streams (a collective: all ranks call save)
        if self.accelerator.is_main_process:
            state = {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.batch * self.samples_per_batch,
                     "world_size": self.accelerator.num_processes, "engine": self.accelerator.name,
                     "config": asdict(self.cfg)}
            save_checkpoint(self.checkpoints, self.step, model=self.accelerator.unwrap_model(self.model),
                            optimizer=self.optimizer, scheduler=self.scheduler, state=state, keep=self.cfg.keep,
                            scaler=getattr(self.accelerator, "scaler", None), rng_states=rng_states)

    def restore(self):
        """Continue from --resume (or from the latest checkpoint after a torchrun/toolkit launch restart)."""
        cfg, accelerator = self.cfg, self.accelerator
        resume = cfg.resume or ("auto" if accelerator.env.restart_count else None)
        if accelerator.env.restart_count:
            accelerator.print(f"[toolkit] restart {accelerator.env.restart_count}: resuming from the latest checkpoint")
        path = latest_checkpoint(self.checkpoints) if resume == "auto" else resume and Path(resume)
        if path is None:
            return
        state = load_checkpoint(path, model=accelerator.unwrap_model(self.model), optimizer=self.optimizer,
                                scheduler=self.scheduler, scaler=getattr(accelerator, "scaler", None))
        if state["config"]["model"] != cfg.model:
            raise UserError(f"{path} holds a {state['config']['model']} model, not {cfg.model}; "
                            "pick another --output-dir.")
        accelerator.print(f"resumed from {path} (step {state['step']})")
        self.step, self.epoch, steps_done = resume_position(state, self.samples_per_batch * cfg.grad_accum, accelerator)
        self.batch = steps_done * cfg.grad_accum


def train_epoch(run: Run, loader, records, progress, stop: StopRequest) -> bool:
    """Train from (run.epoch, run.batch) to the epoch's end or the last step; True when asked to stop."""
    cfg, accelerator, model, optimizer = run.cfg, run.accelerator, run.model, run.optimizer
    tick, stopping = time.perf_counter(), False
    for batch, (images, labels) in enumerate(epoch_batches(loader, run.epoch, run.batch), run.batch):
        if batch >= run.micro_per_epoch or run.step >= run.total_steps:
            break
        if cfg.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(images), labels)
            if run.step + 1 == cfg.debug_nan_step and accelerator.is_main_process:
                loss = loss * float("nan")
            losses, bad_ranks, stopping = step_status(loss, stop, accelerator)
            if bad_ranks and not cfg.skip_nonfinite:
                raise RunFailure(f"the loss is not finite at step {run.step + 1} on rank(s) {bad_ranks}; stopped "
                                 f"with the checkpoints of step {run.step} and before intact (--skip-nonfinite skips such steps).")
            if not bad_ranks:
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        run.images += run.samples_per_batch
        if not accelerator.sync_gradients:
            continue
        run.scheduler.step()
        run.step, run.batch = run.step + 1, batch + 1
        rate = run.images / (run.seconds + time.perf_counter() - tick)
        mean_loss, lr = losses.mean().item(), run.scheduler.get_last_lr()[0]
        records.log("step", step=run.step, epoch=run.epoch, loss=mean_loss, lr=lr, images_per_s=round(rate, 1),
                    **({"skipped_ranks": bad_ranks} if bad_ranks else {}))
        progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.3g}", img_s=f"{rate:.0f}", refresh=False)
        progress.update()
        if stopping or cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0:
            run.save()
        if stopping:
            break
    run.seconds += time.perf_counter() - tick
    return stopping


def main(argv=None):
    cfg = toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0])
    check_config(cfg)
    accelerator = toolkit.build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision,
                                            gradient_accumulation_steps=cfg.grad_accum, timeout=cfg.timeout)
    accelerator.set_seed(cfg.seed)
    with accelerator.main_process_first():  # one download, not one per rank
        data = load_data(cfg.dataset, cfg.data_dir, cfg.seed)
    train_loader, test_loader = build_loaders(cfg, data, accelerator)
    model, optimizer, bn_fallback = build_model_and_optimizer(cfg, data.num_classes, accelerator)
    micro_per_epoch = len(train_loader) // cfg.grad_accum * cfg.grad_accum
    total_steps = min(cfg.epochs * micro_per_epoch // cfg.grad_accum, cfg.max_steps or float("inf"))
    # Stepped by hand once per optimizer step (not prepared: Accelerate would tick it once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(total_steps))
    run = Run(cfg, accelerator, model, optimizer, scheduler, cfg.batch_size * accelerator.num_processes,
              micro_per_epoch, total_steps)
    run.restore()
    accelerator.print(f"{cfg.model} on {data.name}: {len(data.train_x)} train / {len(data.test_x)} test images; "
                      f"engine {accelerator.name} x {accelerator.num_processes} process(es); batch {cfg.batch_size} "
                      f"per process, {run.samples_per_batch * cfg.grad_accum} global; {total_steps} steps; "
                      f"mixed precision {accelerator.mixed_precision}")

    records = RunRecorder(cfg.output_dir, active=accelerator.is_main_process)
    progress = tqdm(total=total_steps, initial=run.step, disable=not accelerator.is_main_process, dynamic_ncols=True)
    metrics = {}
    with StopRequest() as stop:
        try:
            while run.epoch < cfg.epochs and run.step < total_steps:
                if train_epoch(run, train_loader, records, progress, stop):
                    accelerator.print(f"interrupted at step {run.step}: checkpoint saved; resume with --resume auto")
                    raise SystemExit(130)
                if run.batch >= micro_per_epoch:  # the epoch is complete: the next one starts at its beginning
                    run.epoch, run.batch = run.epoch + 1, 0
                run.save()
                if run.epoch % cfg.eval_every == 0 or run.epoch == cfg.epochs or run.step >= total_steps:
                    if bn_fallback:
                        average_batchnorm_stats(model, accelerator)
                    metrics = evaluate(model, test_loader, accelerator)
                    records.log("epoch", step=run.step, epoch=run.epoch, test_accuracy=metrics["accuracy"],
                                test_loss=metrics["loss"], test_count=metrics["count"])
                    accelerator.print(f"epoch {run.epoch}: test accuracy {metrics['accuracy']:.4f}")
        except Exception as error:
            if is_peer_failure(error):
                raise RunFailure(peer_failure_message(error, accelerator, run.step, cfg.timeout)) from None
            raise
        finally:
            progress.close()
    if not metrics:  # resumed a finished run: nothing trained, the model still gets its report
        metrics = evaluate(model, test_loader, accelerator)
    summary = records.summary(
        test_accuracy=metrics["accuracy"], test_loss=metrics["loss"], test_count=metrics["count"], steps=run.step,
        images_per_s=round(run.images / run.seconds, 1) if run.seconds else None, engine=accelerator.name,
        world_size=accelerator.num_processes, mixed_precision=accelerator.mixed_precision, config=asdict(cfg),
        skipped_steps=accelerator.skipped_steps)
    records.close()
    accelerator.print(f"done: test accuracy {summary['test_accuracy']}, {summary['images_per_s']} images/s"
                      + (f", {summary['skipped_steps']} optimizer step(s) skipped (fp16 overflow or non-finite loss)"
                         if summary["skipped_steps"] else ""))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
