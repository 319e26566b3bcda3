"""Train any torchvision classifier on your own folder of images: the classic DDP tutorial, on every launcher.

    python recipes/images.py --data-dir data/pets --model resnet18 --image-size 224        # one process
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/images.py --data-dir data/pets
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/images.py --data-dir data/pets
    torchrun --nproc_per_node 2 recipes/images.py --data-dir data/pets --engine ddp
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml --engine ddp recipes/images.py --data-dir data/pets
    python recipes/images.py --data-dir hf:data/pets_parquet --model resnet50 --weights resnet50.pth
    python recipes/images.py --data-dir data/pets --model timm:resnet18.a1_in1k --weights pretrained --freeze-backbone

--data-dir holds train/<class>/* and val/<class>/* (or test/<class>/*), as torchvision's ImageFolder reads
them, or is hf:PATH (a save_to_disk folder or parquet files). Images of any size and mode are read as RGB;
class names are the folder names sorted as ImageFolder sorts them, saved in every checkpoint and in
summary.json. --model is any torchvision classification model, timm:NAME (any timm model) or one of the
toolkit's nets (tiny, resnet9, toolkit:resnet18); --weights starts from a local state dict, or from the model's
published weights in the local cache (pretrained; nothing is downloaded), with a new classifier head when the
class count differs; --freeze-backbone trains the head alone, --head-lr gives it its own learning rate. DataLoader workers decode: RandomResizedCrop
and flip for training, resize and centre crop for evaluation. The global batch, presets, exact mid-epoch
resume and records are cifar.py's. An unreadable image file stops the run with its path (exit 2).
"""

from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import toolkit
from toolkit.data.folder import StreamingLoader, default_workers, image_transform, open_images
from toolkit.data.memory import AUGMENTATIONS
from toolkit.models.timm_models import is_timm_model
from toolkit.plan import plan_run, workloads
from toolkit.models.vision import (TOOLKIT_PREFIX, build_image_model, freeze_backbone, head_parameter_names,
                                   is_torchvision_model)
from toolkit.train import (EvalMetrics, TrainingConfig, TrainingRun, WeightEMA, adapt_model, apply_preset,
                           average_batchnorm_stats, build_optimizer, check_config, decay_groups, flops_per_sample,
                           lr_schedule, plan_batches, run_guard)


@dataclass
class Config(TrainingConfig):  # the shared training flags (toolkit/train/config.py) plus this recipe's
    data_dir: str = field(default="data/images", metadata={"help": "ImageFolder layout (train/, val/ or test/) "
                          "or hf:PATH (save_to_disk folder or parquet files)"})
    model: str = field(default="resnet18", metadata={"help": "a torchvision classification model, or tiny, "
                       "resnet9, toolkit:resnet18 (the toolkit's nets)"})
    image_size: int = field(default=224, metadata={"help": "pixels per side the model sees"})
    weights: str | None = field(default=None, metadata={"help": "a local state dict to start from (.safetensors, a "
                                "torchvision or timm .pth, or a run's checkpoints/step-N/model.safetensors), or "
                                "'pretrained': the model's published weights from the local Hugging Face or torch hub "
                                "cache, never downloaded; a new classifier head when the class count differs"})
    freeze_backbone: bool = field(default=False, metadata={"help": "train the classifier head alone (the backbone's "
                                  "weights fixed, as from --weights)"})
    head_lr: float | None = field(default=None, metadata={"help": "the classifier head's peak learning rate "
                                  "(default: --lr, the same as the backbone's)"})
    augment: str = field(default="crop-flip", metadata={"choices": list(AUGMENTATIONS),
                         "help": "RandomResizedCrop + flip, RandomResizedCrop, or resize + centre crop"})
    workers: int | None = field(default=None, metadata={"help": "decoding workers per process "
                                "(default: the cores per process, at most 8)"})
    output_dir: str = field(default="runs/images", metadata={"help": "checkpoints, metrics and summary.json"})


def build_loaders(cfg, data, accelerator, micro_batch: int):
    """Training batches decoded by workers, sharded so that every optimizer step holds the same images on any
    world size; the validation set prepared, so gather_for_metrics counts each image once."""
    workers = cfg.workers if cfg.workers is not None else default_workers(accelerator.env.local_world_size)
    train = StreamingLoader(data.train, micro_batch, rank=accelerator.process_index, seed=cfg.seed,
                            world_size=accelerator.num_processes, image_size=cfg.image_size, workers=workers,
                            device=accelerator.device, train=True, augment=cfg.augment)
    val = data.val.with_transform(image_transform(cfg.image_size, train=False))
    return train, accelerator.prepare(DataLoader(val, micro_batch, num_workers=workers))


def image_model(cfg, classes: int, say):
    """--model with `classes` outputs, from --weights when given (a new head when the class count differs), its
    backbone fixed with --freeze-backbone."""
    model = build_image_model(cfg.model, classes, cfg.image_size, weights=cfg.weights, say=say)
    if cfg.freeze_backbone:
        frozen, trained = freeze_backbone(model)
        say(f"[toolkit] --freeze-backbone: {frozen:,} backbone parameters fixed, {trained:,} in the head trained")
    return model


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


def parse_config(argv=None) -> tuple[Config, str]:
    """The flags, with the model's preset filled in (and the line that says where the lr came from), checked."""
    cfg = toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0])
    # torchvision's and timm's models share torchvision's reference recipe; the toolkit's nets have their own presets.
    own = not (is_torchvision_model(cfg.model) or is_timm_model(cfg.model))
    cfg, lr_rule = apply_preset(cfg, cfg.model.removeprefix(TOOLKIT_PREFIX) if own else "torchvision")
    check_config(cfg)
    if cfg.image_size < 1 or cfg.workers is not None and cfg.workers < 0 or cfg.head_lr is not None and cfg.head_lr <= 0:
        raise toolkit.UserError("--image-size must be at least 1, --workers at least 0 and --head-lr positive.")
    return cfg, lr_rule


def main(argv=None):
    cfg, lr_rule = parse_config(argv)
    accelerator = toolkit.build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision, timeout=cfg.timeout,
                                            log_with=cfg.trackers, project_dir=cfg.output_dir,
                                            checkpoint_format=cfg.checkpoint_format)
    accelerator.set_seed(cfg.seed)
    with accelerator.main_process_first():  # one parquet cache, not one per rank
        data = open_images(cfg.data_dir, cache_dir=cfg.output_dir)
    # toolkit plan's prediction for this run, checked after the first evaluation (--micro-batch-size auto: its pick)
    shape_only = replace(cfg, weights=None)  # the plan builds the model on fake tensors: no weights to read
    forecast = plan_run(cfg, accelerator, workloads.images(cfg.model, lambda: image_model(shape_only, len(data.classes),
                        lambda line: None), len(data.classes), cfg.image_size, cfg.optimizer))
    plan = plan_batches(cfg.global_batch_size, accelerator.num_processes, forecast.micro_batch, forecast.said)
    accelerator.gradient_accumulation_steps = plan.accumulation
    train_loader, val_loader = build_loaders(cfg, data, accelerator, plan.micro_batch)

    model = image_model(cfg, len(data.classes), accelerator.print)
    flops = flops_per_sample(model, torch.zeros(1, 3, cfg.image_size, cfg.image_size))  # one image's, for MFU
    model, average_bn = adapt_model(model, cfg, accelerator)
    # sgd or adamw; the classifier head at --head-lr when given (a frozen backbone has no parameters to train)
    groups = decay_groups(model, cfg.weight_decay, head=head_parameter_names(model), head_lr=cfg.head_lr)
    optimizer = build_optimizer(cfg.optimizer, groups, lr=cfg.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader), flops_per_sample=flops,
                      forecast=forecast)
    run.config["classes"] = data.classes  # saved with every checkpoint: the model's outputs, named
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
    accelerator.print(f"{cfg.model} at {cfg.image_size}px on {data.name}: {len(data.train)} train / {len(data.val)} "
                      f"val images, {len(data.classes)} classes; engine {accelerator.name}; global batch {plan}; "
                      f"{run.total_steps} steps; {lr_rule}; mixed precision {accelerator.mixed_precision}; "
                      f"{accelerator.threads}")
    run.divergence.started(classes=len(data.classes))  # one line if the schedule is too short to start at full lr

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
                metrics = evaluate(model, val_loader, accelerator, len(data.classes), ema)
                accelerator.log(run.evaluated(metrics), step=run.step)
    metrics = metrics or evaluate(model, val_loader, accelerator, len(data.classes), ema)
    summary = run.finish(metrics, dataset=data.name, classes=data.classes)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
