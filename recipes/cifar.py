"""Train a ResNet on CIFAR-10/100 with the Accelerator API: one script from one CPU to many GPUs on many nodes.

    python recipes/cifar.py --dataset synthetic --model tiny --epochs 2          # one process
    accelerate launch recipes/cifar.py                                           # accelerate's default config
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar.py --dataset synthetic
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/cifar.py
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank R recipes/cifar.py
    torchrun --nproc_per_node 2 recipes/cifar.py --engine ddp
    torchrun --nproc_per_node 2 recipes/cifar.py --engine fsdp                   # the model sharded (FSDP2)
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/cifar.py
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml --engine ddp recipes/cifar.py
    python recipes/cifar.py --engine dp                                          # nn.DataParallel

The engine (accelerate, ddp, fsdp, dp, single) follows from the launcher; nothing below asks which one runs.
--global-batch-size is the images in one optimizer step over all processes, the same under every launcher:
global batch = processes x --micro-batch-size x gradient accumulation, the accumulation derived. Learning
rate, weight decay, warm-up, epochs and global batch default to the model's preset (toolkit/train/presets.py).
Mixed precision comes from the accelerate profile unless --mixed-precision is given. The toolkit's parts
(toolkit/train) keep the position for an exact mid-epoch resume, stop cleanly on Ctrl-C, a NaN or a lost peer,
and write the run's records; the training step itself is below.
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import toolkit
from toolkit.data import DATASET_CHOICES, load_data
from toolkit.data.memory import AUGMENTATIONS, MemoryLoader, build_torch_loader, normalize
from toolkit.models.nets import MODELS, build_model
from toolkit.plan import plan_run, workloads
from toolkit.train import (EvalMetrics, TrainingConfig, TrainingRun, WeightEMA, adapt_model, apply_preset,
                           average_batchnorm_stats, build_optimizer, check_config, decay_groups, flops_per_sample,
                           lr_schedule, plan_batches, run_guard)


@dataclass
class Config(TrainingConfig):  # the shared training flags (toolkit/train/config.py) plus this recipe's
    dataset: str = field(default="cifar10", metadata={"help": DATASET_CHOICES})
    data_dir: str = field(default="data", metadata={"help": "folder holding (or receiving) the dataset"})
    model: str = field(default="resnet18", metadata={"choices": sorted(MODELS)})
    augment: str = field(default="crop-flip", metadata={"choices": list(AUGMENTATIONS),
                         "help": "training augmentation (flips are wrong for digits and text)"})
    loader: str = field(default="memory", metadata={"choices": ["memory", "torch"]})
    output_dir: str = field(default="runs/cifar", metadata={"help": "checkpoints, metrics and summary.json"})


def build_loaders(cfg, data, accelerator, micro_batch: int):
    """Training batches sharded so that every optimizer step holds the same images on any world size; the test
    set prepared, so gather_for_metrics counts each image once."""
    if cfg.loader == "memory":  # the whole set on the device, augmented there
        train = MemoryLoader(data.train_x, data.train_y, micro_batch, rank=accelerator.process_index,
                             world_size=accelerator.num_processes, seed=cfg.seed, device=accelerator.device,
                             augment=cfg.augment)
    else:
        train = accelerator.prepare(build_torch_loader(data.train_x, data.train_y, micro_batch, train=True,
                                                       seed=cfg.seed, augment=cfg.augment))
    test = accelerator.prepare(DataLoader(TensorDataset(normalize(data.test_x), data.test_y), micro_batch))
    return train, test


@torch.no_grad()
def evaluate(model, loader, accelerator, classes: int, ema=None) -> dict:
    """Accuracy and mean loss over a prepared loader: gather_for_metrics drops the samples the sampler repeated
    to even out the last batch, so every image counts once on any world size; top-5, per-class accuracy and the
    confusion matrix too. With --ema-decay, the averaged weights' figures, under "ema"."""
    model.eval()
    metrics = EvalMetrics(num_classes=classes)
    for inputs, targets in loader:
        metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    model.train()
    if ema is None:
        return metrics.compute()
    with ema.swapped():
        return {**metrics.compute(), "ema": evaluate(model, loader, accelerator, classes)}


def main(argv=None):
    cfg, lr_rule = apply_preset(toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0]))
    check_config(cfg)
    accelerator = toolkit.build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision, timeout=cfg.timeout,
                                            log_with=cfg.trackers, project_dir=cfg.output_dir,
                                            checkpoint_format=cfg.checkpoint_format)
    accelerator.set_seed(cfg.seed)
    with accelerator.main_process_first():  # one download, not one per rank
        data = load_data(cfg.dataset, cfg.data_dir, cfg.seed)
    # toolkit plan's prediction for this run, checked after the first evaluation (--micro-batch-size auto: its pick)
    forecast = plan_run(cfg, accelerator, workloads.images(cfg.model, lambda: build_model(cfg.model, data.num_classes),
                                                           data.num_classes, optimizer=cfg.optimizer))
    plan = plan_batches(cfg.global_batch_size, accelerator.num_processes, forecast.micro_batch, forecast.said)
    accelerator.gradient_accumulation_steps = plan.accumulation
    train_loader, test_loader = build_loaders(cfg, data, accelerator, plan.micro_batch)

    model = build_model(cfg.model, data.num_classes)
    flops = flops_per_sample(model, torch.zeros(1, 3, 32, 32))  # one image's forward and backward, for MFU
    model, average_bn = adapt_model(model, cfg, accelerator)
    optimizer = build_optimizer(cfg.optimizer, decay_groups(model, cfg.weight_decay), lr=cfg.lr)  # sgd or adamw
    model, optimizer = accelerator.prepare(model, optimizer)
    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader), flops_per_sample=flops,
                      forecast=forecast)
    # Stepped once per optimizer step below (a prepared one ticks once per process), saved with the state.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.schedule, run.total_steps, cfg.warmup))
    ema = WeightEMA(model, cfg.ema_decay, accelerator) if cfg.ema_decay else None  # --ema-decay: averaged weights
    checkpointed = [scheduler, run, *([ema] if ema else [])]  # in every save_state, in this order
    accelerator.register_for_checkpointing(*checkpointed)
    resume = run.resume_folder(model, optimizer, checkpointed)  # --resume, or a restart: start, load_state, ...
    if resume.action == "load_state":
        accelerator.load_state(resume.folder)  # weights, optimizer, schedule, every rank's RNG and the run's position
    if resume.action == "finished":  # a run that had ended: its summary.json stands, nothing is trained or rewritten
        accelerator.end_training()
        return run.finished
    accelerator.init_trackers("logs", config=asdict(cfg))  # --log-with's trackers, in OUTPUT_DIR/logs
    accelerator.print(f"{cfg.model} on {data.name}: {len(data.train_x)} train / {len(data.test_x)} test images; "
                      f"engine {accelerator.name}; global batch {plan}; {run.total_steps} steps; {lr_rule}; "
                      f"mixed precision {accelerator.mixed_precision}; {accelerator.threads}")
    run.divergence.started(classes=data.num_classes)  # one line if the schedule is too short to start at full lr

    def save_checkpoint():  # on every rank: under fsdp the weights are gathered (or each rank writes its shards)
        if average_bn:  # --sync-bn on CPU ranks: every rank saves, then evaluates, the ranks' mean statistics
            average_batchnorm_stats(model, accelerator)
        run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder()))

    metrics, norm = None, {}
    with run_guard(run) as guard:  # Ctrl-C/SIGTERM: a checkpoint at the next step, then exit 130
        for epoch in run.epochs():
            model.train()
            for images, labels in run.batches(train_loader):  # from the saved position; whole optimizer steps
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(images), labels, label_smoothing=cfg.label_smoothing)
                    if guard.should_backward(loss):  # False on every rank when --skip-nonfinite skips this step
                        accelerator.backward(loss)
                    guard.check()  # every rank's loss, read once backward is queued: a NaN stops before the step
                    if accelerator.sync_gradients and cfg.clip_grad_norm:  # the whole step's gradient, once
                        norm = {"grad_norm": accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm).item()}
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:  # an optimizer step is complete
                    scheduler.step()
                    if ema:
                        ema.update()
                    accelerator.log(run.step_done(lr=scheduler.get_last_lr()[0], **norm, **guard.step_done()),
                                    step=run.step)
                    if guard.stop_requested or run.checkpoint_due():
                        save_checkpoint()
                    guard.stop_if_asked()
            save_checkpoint()
            if run.evaluation_due():
                metrics = evaluate(model, test_loader, accelerator, data.num_classes, ema)
                accelerator.log(run.evaluated(metrics), step=run.step)
    summary = run.finish(metrics or evaluate(model, test_loader, accelerator, data.num_classes, ema))
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
