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

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

import toolkit
from toolkit.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from toolkit.data import MemoryLoader, build_torch_loader, load_data
from toolkit.errors import UserError
from toolkit.models import MODELS, build_model
from toolkit.records import RunRecorder
from toolkit.training import (average_batchnorm_stats, convert_sync_batchnorm, epoch_batches, evaluate,
                              resume_position, warmup_linear_decay)


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


def check_config(cfg: Config):
    for name in ("epochs", "batch_size", "grad_accum", "keep", "eval_every"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}.")
    if cfg.max_steps is not None and cfg.max_steps < 1 or cfg.checkpoint_every < 0 or cfg.lr <= 0:
        raise UserError("--max-steps must be at least 1, --checkpoint-every at least 0 and --lr positive.")


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


def restore(cfg, model, optimizer, scheduler, accelerator, checkpoints: Path, samples_per_step: int):
    """(step, epoch, start_batch) from --resume, or zeros for a fresh run."""
    path = latest_checkpoint(checkpoints) if cfg.resume == "auto" else cfg.resume and Path(cfg.resume)
    if path is None:
        return 0, 0, 0
    state = load_checkpoint(path, model=accelerator.unwrap_model(model), optimizer=optimizer, scheduler=scheduler,
                            scaler=getattr(accelerator, "scaler", None))
    if state["config"]["model"] != cfg.model:
        raise UserError(f"{path} holds a {state['config']['model']} model, not {cfg.model}; pick another --output-dir.")
    accelerator.print(f"resumed from {path} (step {state['step']})")
    return resume_position(state, samples_per_step, accelerator)


def save(cfg, checkpoints, accelerator, model, optimizer, scheduler, step, epoch, batch, samples_per_batch):
    if accelerator.is_main_process:
        state = {"step": step, "epoch": epoch, "samples_in_epoch": batch * samples_per_batch,
                 "world_size": accelerator.num_processes, "engine": accelerator.name, "config": asdict(cfg)}
        save_checkpoint(checkpoints, step, model=accelerator.unwrap_model(model), optimizer=optimizer,
                        scheduler=scheduler, scaler=getattr(accelerator, "scaler", None), state=state, keep=cfg.keep)


def main(argv=None):
    cfg = toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0])
    check_config(cfg)
    accelerator = toolkit.build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision,
                                            gradient_accumulation_steps=cfg.grad_accum)
    accelerator.set_seed(cfg.seed)
    with accelerator.main_process_first():  # one download, not one per rank
        data = load_data(cfg.dataset, cfg.data_dir, cfg.seed)
    train_loader, test_loader = build_loaders(cfg, data, accelerator)
    model, optimizer, bn_fallback = build_model_and_optimizer(cfg, data.num_classes, accelerator)

    micro_per_epoch = len(train_loader) // cfg.grad_accum * cfg.grad_accum  # whole optimizer steps only
    samples_per_batch = cfg.batch_size * accelerator.num_processes  # one micro-step over all ranks
    total_steps = min(cfg.epochs * micro_per_epoch // cfg.grad_accum, cfg.max_steps or float("inf"))
    # Stepped by hand once per optimizer step (not prepared: Accelerate would tick it once per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(total_steps))
    checkpoints = Path(cfg.output_dir) / "checkpoints"
    step, first_epoch, start_step = restore(cfg, model, optimizer, scheduler, accelerator, checkpoints,
                                            samples_per_batch * cfg.grad_accum)
    start_batch = start_step * cfg.grad_accum
    accelerator.print(f"{cfg.model} on {data.name}: {len(data.train_x)} train / {len(data.test_x)} test images; "
                      f"engine {accelerator.name} x {accelerator.num_processes} process(es); batch "
                      f"{cfg.batch_size} per process, {samples_per_batch * cfg.grad_accum} global; {total_steps} steps; "
                      f"mixed precision {accelerator.mixed_precision}")

    records = RunRecorder(cfg.output_dir, active=accelerator.is_main_process)
    progress = tqdm(total=total_steps, initial=step, disable=not accelerator.is_main_process, dynamic_ncols=True)
    trained_images, train_time, metrics = 0, 0.0, {}
    epoch, position = first_epoch, start_batch  # position: micro-batches of this epoch done (whole steps)
    try:
        for epoch in range(first_epoch, cfg.epochs):
            if step >= total_steps:
                break
            tick = time.perf_counter()
            for batch, (images, labels) in enumerate(epoch_batches(train_loader, epoch, position), position):
                if batch >= micro_per_epoch or step >= total_steps:
                    break
                if cfg.channels_last:
                    images = images.contiguous(memory_format=torch.channels_last)
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(images), labels)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                trained_images += samples_per_batch
                if not accelerator.sync_gradients:
                    continue
                scheduler.step()
                step, position = step + 1, batch + 1
                mean_loss = accelerator.reduce(loss.detach(), "mean").item()
                rate = trained_images / (train_time + time.perf_counter() - tick)
                lr = scheduler.get_last_lr()[0]
                records.log("step", step=step, epoch=epoch, loss=mean_loss, lr=lr, images_per_s=round(rate, 1))
                progress.set_postfix(loss=f"{mean_loss:.3f}", lr=f"{lr:.3g}", img_s=f"{rate:.0f}", refresh=False)
                progress.update()
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                    save(cfg, checkpoints, accelerator, model, optimizer, scheduler, step, epoch, position,
                         samples_per_batch)
            train_time += time.perf_counter() - tick
            if position >= micro_per_epoch:  # the epoch is complete: the next one starts at its beginning
                epoch, position = epoch + 1, 0
            save(cfg, checkpoints, accelerator, model, optimizer, scheduler, step, epoch, position, samples_per_batch)
            if epoch % cfg.eval_every == 0 or epoch == cfg.epochs or step >= total_steps:
                if bn_fallback:
                    average_batchnorm_stats(model, accelerator)
                metrics = evaluate(model, test_loader, accelerator)
                records.log("epoch", step=step, epoch=epoch, test_accuracy=metrics["accuracy"],
                            test_loss=metrics["loss"], test_count=metrics["count"])
                accelerator.print(f"epoch {epoch}: test accuracy {metrics['accuracy']:.4f}, loss {metrics['loss']:.4f}")
            accelerator.wait_for_everyone()
    except KeyboardInterrupt:
        accelerator.print(f"interrupted at step {step}: saving a checkpoint to resume from")
        save(cfg, checkpoints, accelerator, model, optimizer, scheduler, step, epoch, position, samples_per_batch)
        raise SystemExit(130)
    finally:
        progress.close()
    summary = records.summary(
        test_accuracy=metrics.get("accuracy"), test_loss=metrics.get("loss"), test_count=metrics.get("count"),
        steps=step, images_per_s=round(trained_images / max(train_time, 1e-9), 1), engine=accelerator.name,
        world_size=accelerator.num_processes, mixed_precision=accelerator.mixed_precision, config=asdict(cfg))
    records.close()
    accelerator.print(f"done: test accuracy {summary['test_accuracy']}, {summary['images_per_s']} images/s")
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
