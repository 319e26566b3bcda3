"""Optimizer pieces a recipe builds its optimizer and schedule from: parameter groups without weight decay on
biases and norms (and a classifier head at its own learning rate), --optimizer, and learning-rate multipliers per
optimizer step for --schedule (for `torch.optim.lr_scheduler.LambdaLR`).

    optimizer = build_optimizer(cfg.optimizer, decay_groups(model, cfg.weight_decay), lr=cfg.lr)
    scheduler = LambdaLR(optimizer, lr_schedule(cfg.schedule, run.total_steps, cfg.warmup))
"""

from __future__ import annotations

import math

from toolkit.errors import UserError
from toolkit.train.config import OPTIMIZERS, SCHEDULES


def decay_groups(model, weight_decay: float, head=(), head_lr: float | None = None) -> list[dict]:
    """Parameter groups: matrices and kernels with `weight_decay`, biases and norm weights (1-d) without; the
    parameters named in `head` (a classifier head) in groups of their own at `head_lr` when given. Frozen
    parameters (requires_grad False: --freeze-backbone) are left out. LambdaLR scales every group's lr alike.

    >>> import torch
    >>> [len(g["params"]) for g in decay_groups(torch.nn.Linear(3, 2), 0.1)]
    [1, 1]
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    >>> [(len(g["params"]), g["weight_decay"], g.get("lr")) for g in decay_groups(net, 0.1, {"1.weight", "1.bias"}, 0.5)]
    [(1, 0.1, None), (1, 0.0, None), (1, 0.1, 0.5), (1, 0.0, 0.5)]
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = []
    for part in (False, True) if head_lr is not None else (None,):
        chosen = [p for name, p in named if part is None or (name in head) == part]
        extra = {"lr": head_lr} if part else {}
        groups += [{"params": [p for p in chosen if p.ndim > 1], "weight_decay": weight_decay, **extra},
                   {"params": [p for p in chosen if p.ndim <= 1], "weight_decay": 0.0, **extra}]
    return groups


def build_optimizer(name: str, groups: list[dict], lr: float, betas=(0.9, 0.999)):
    """--optimizer: `sgd`, SGD with Nesterov momentum 0.9 (the ResNet recipes'), or `adamw`, AdamW (Loshchilov and
    Hutter 2019: weight decay decoupled from the gradient's moments) with `betas`. `groups` from decay_groups.

    >>> import torch
    >>> type(build_optimizer("adamw", decay_groups(torch.nn.Linear(3, 2), 0.05), lr=1e-3)).__name__
    'AdamW'
    """
    import torch

    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas)
    raise UserError(f"--optimizer {name}: choose one of {', '.join(OPTIMIZERS)}.")


def lr_schedule(name: str, total_steps: int, warmup_fraction: float):
    """--schedule: the lr multiplier for each optimizer step, after a linear warm-up over the first
    `warmup_fraction` of the steps: `linear` decay to 0, `cosine` decay to lr/10, or `constant`.

    >>> [round(lr_schedule("constant", 10, 0.2)(s), 3) for s in (0, 1, 2, 9)]
    [0.5, 1.0, 1.0, 1.0]
    """
    if name == "linear":
        return warmup_linear_decay(total_steps, warmup_fraction)
    if name == "cosine":
        return warmup_cosine(total_steps, warmup_fraction)
    if name == "constant":
        warmup = _warmup_steps(total_steps, warmup_fraction)
        return lambda step: min(1.0, (step + 1) / warmup)
    raise UserError(f"--schedule {name}: choose one of {', '.join(SCHEDULES)}.")


def _warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    return max(1, int(total_steps * warmup_fraction))


def warmup_linear_decay(total_steps: int, warmup_fraction: float = 0.2):
    """LR multiplier for step s: linear warm-up to 1 over the first steps, then linear decay to 0.

    >>> factor = warmup_linear_decay(10, 0.2)
    >>> [round(factor(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    warmup = _warmup_steps(total_steps, warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def warmup_cosine(total_steps: int, warmup_fraction: float = 0.1, floor: float = 0.1):
    """LR multiplier for step s: linear warm-up to 1, then cosine decay to `floor` (nanoGPT's min_lr = lr/10).

    >>> factor = warmup_cosine(10, 0.2)
    >>> [round(factor(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.55, 0.1]
    """
    warmup = _warmup_steps(total_steps, warmup_fraction)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
