"""Per-model training presets: the hyperparameters a model trains well with, each with its source.

A preset is stated at its own global batch (images per optimizer step over all processes), so it means
the same thing on one CPU and on 64 GPUs. Flags override presets. When the global batch is changed
and --lr is not given, the learning rate follows the linear scaling rule with warm-up (Goyal et al.
2017, "Accurate, Large Minibatch SGD"): lr = preset lr x global batch / preset global batch.

    >>> from toolkit.train.config import TrainingConfig
    >>> cfg, rule = apply_preset(TrainingConfig(model="tiny", global_batch_size=128))
    >>> cfg.lr, rule
    (0.08, 'sgd, linear schedule; lr 0.08 = 0.04 x 128/64, linear scaling (Goyal et al. 2017)')
    >>> cfg, rule = apply_preset(TrainingConfig(model="resnet18", optimizer="adamw", global_batch_size=256))
    >>> cfg.lr, cfg.weight_decay, rule
    (0.00025, 0.05, 'adamw, cosine schedule; lr 0.00025 = 0.0005 x 256/512, linear scaling (Goyal et al. 2017)')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from toolkit.errors import UserError

LR_RULE = "linear scaling (Goyal et al. 2017)"


@dataclass(frozen=True)
class Preset:
    global_batch_size: int  # images per optimizer step, all processes together
    lr: float  # peak learning rate at that global batch (the recipe's optimizer, mean loss)
    weight_decay: float  # L2 on weights (not on biases and norms)
    warmup: float  # fraction of the optimizer steps spent warming up linearly; then linear decay to 0
    epochs: int
    label_smoothing: float
    clip_grad_norm: float | None = None  # the global gradient norm clipped to this; None: no clipping
    optimizer: str = "sgd"  # sgd: Nesterov momentum 0.9; adamw: decoupled weight decay (toolkit/train/optim.py)
    schedule: str = "linear"  # after the warm-up: linear or cosine decay, or constant


PRESETS = {
    # Measured here (2 CPU cores, MemoryLoader): at G=64, lr 0.2 diverges (test accuracy 0.10) and 0.1 spikes
    # (a step loss 1.7 x the first); 0.04 trains stably: synthetic data 0.964-0.980 after 3 epochs (seeds 0-3,
    # no step loss above 0.93 x the first after warm-up), sklearn's digits at 32x32 0.963-0.987 after 15
    # epochs with --augment crop (seeds 0-2). warmup, weight decay: the values those runs used.
    "tiny": Preset(global_batch_size=64, lr=0.04, weight_decay=5e-4, warmup=0.2, epochs=15, label_smoothing=0.0),
    # David Page, "How to train your ResNet" (Myrtle.ai, 2018), the DAWNBench ResNet-9: batch 512, lr linear
    # 0 -> 0.4 over 5 epochs then -> 0 at epoch 24, weight decay 5e-4, Nesterov momentum 0.9 (his summed loss
    # with lr/512 and wd x 512 is this mean-loss setting); 94% CIFAR-10 test accuracy in 24 epochs.
    "resnet9": Preset(global_batch_size=512, lr=0.4, weight_decay=5e-4, warmup=5 / 24, epochs=24,
                      label_smoothing=0.0),
    # kuangliu/pytorch-cifar (ResNet18 listed at 93.02%): batch 128, lr 0.1, momentum 0.9, weight decay 5e-4,
    # 200 epochs. Warm-up: 5 epochs as in Goyal et al.; linear decay stands in for its step/cosine schedule.
    "resnet18": Preset(global_batch_size=128, lr=0.1, weight_decay=5e-4, warmup=5 / 200, epochs=200,
                       label_smoothing=0.0),
    # Any torchvision classification model (recipes/images.py): torchvision's reference classification recipe
    # (references/classification/README.md, ResNet): 8 GPUs x batch 32 = 256, SGD lr 0.1, momentum 0.9, weight
    # decay 1e-4, 90 epochs, no warm-up; linear decay stands in for its lr/10 every 30 epochs. Its ViT and
    # EfficientNet recipes use other optimizers; with SGD these values are a start, not a tuned result.
    "torchvision": Preset(global_batch_size=256, lr=0.1, weight_decay=1e-4, warmup=0.0, epochs=90,
                          label_smoothing=0.0),
    # recipes/lm.py's character-level GPT (toolkit/models/gpt.py) on the shipped Book of Genesis, AdamW: measured
    # here in a plain PyTorch loop, 10 epochs of 86 steps at 32 sequences of 64 characters: lr 1e-3 1.816, 3e-3
    # 1.466, 1e-2 1.353-1.361 (seeds 1-3), 2e-2 1.350 validation nats per character (ln 60 = 4.09 at the start);
    # weight decay 0 1.365, 0.1 1.355; warm-up 0.02 1.376, 0.05 1.355. Clipping at 1.0 as nanoGPT.
    "gpt-tiny": Preset(global_batch_size=32, lr=1e-2, weight_decay=0.1, warmup=0.05, epochs=10, label_smoothing=0.0,
                       clip_grad_norm=1.0, optimizer="adamw", schedule="cosine"),
}
PRESETS["gpt-mini"] = PRESETS["gpt-tiny"]  # twice the blocks: gpt-tiny's settings, not measured apart
# --optimizer naming another optimizer than the preset's: that optimizer's lr, weight decay and schedule (stated at
# their own global batch, scaled linearly as above); the preset's warm-up, epochs and the rest stay.
OTHER_OPTIMIZER = {
    # DeiT (Touvron et al. 2021, "Training data-efficient image transformers", table 9), the usual AdamW start
    # for image models: lr 5e-4 x batch/512, weight decay 0.05, cosine decay.
    "adamw": {"global_batch_size": 512, "lr": 5e-4, "weight_decay": 0.05, "schedule": "cosine"},
}
OTHER_OPTIMIZER_FOR = {
    # Measured here on sklearn's digits at 32x32 (tests/test_optimizers.py): see the test for the figures.
    ("tiny", "adamw"): {"global_batch_size": 64, "lr": 3e-3, "weight_decay": 0.05, "schedule": "cosine"},
}
PRESET_FIELDS = tuple(f.name for f in dataclasses.fields(Preset))


def preset_for(model: str) -> Preset:
    if model not in PRESETS:
        raise UserError(f"no preset for model {model!r}; choose one of {', '.join(PRESETS)} with --model.")
    return PRESETS[model]


def optimizer_settings(preset_name: str, optimizer: str) -> dict | None:
    """lr, weight decay, schedule and their global batch for `optimizer` when the preset trains with another."""
    return OTHER_OPTIMIZER_FOR.get((preset_name, optimizer)) or OTHER_OPTIMIZER.get(optimizer)


def apply_preset(cfg, preset_name: str | None = None):
    """(a copy of `cfg` whose unset (None) preset fields come from its model's preset (or `preset_name`'s),
    how the optimizer, schedule and learning rate were chosen, for the start line); the learning rate scales
    linearly with the global batch when only the batch was changed. --optimizer naming another optimizer than the
    preset's takes that optimizer's settings (OTHER_OPTIMIZER)."""
    name = preset_name or cfg.model
    preset = preset_for(name)
    source = f"the {name} preset"
    if cfg.optimizer is not None and cfg.optimizer != preset.optimizer:
        settings = optimizer_settings(name, cfg.optimizer)
        if settings is None:
            if cfg.lr is None or cfg.weight_decay is None:
                raise UserError(f"the {name} preset has no {cfg.optimizer} settings; give --lr and --weight-decay "
                                f"with --optimizer {cfg.optimizer}.")
            settings = {}
        preset = dataclasses.replace(preset, optimizer=cfg.optimizer, **settings)
        source = f"{cfg.optimizer}'s settings for the {name} preset"
    filled = {name: getattr(preset, name) for name in PRESET_FIELDS if getattr(cfg, name) is None}
    batch = cfg.global_batch_size or preset.global_batch_size
    if cfg.lr is not None:
        rule = "lr from --lr"
    elif batch == preset.global_batch_size:
        rule = f"lr from {source}"
    else:
        filled["lr"] = preset.lr * batch / preset.global_batch_size
        rule = f"lr {filled['lr']:g} = {preset.lr:g} x {batch}/{preset.global_batch_size}, {LR_RULE}"
    cfg = dataclasses.replace(cfg, **filled)
    return cfg, f"{cfg.optimizer}, {cfg.schedule} schedule; {rule}"
