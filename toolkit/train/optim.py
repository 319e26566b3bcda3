"""Optimizer pieces a recipe builds its optimizer and schedule from: parameter groups without weight decay on
biases and norms, and learning-rate multipliers per optimizer step (for `torch.optim.lr_scheduler.LambdaLR`).
"""

from __future__ import annotations

import math


def decay_groups(model, weight_decay: float) -> list[dict]:
    """Two parameter groups: matrices and kernels with `weight_decay`, biases and norm weights (1-d) without.

    >>> import torch
    >>> [len(g["params"]) for g in decay_groups(torch.nn.Linear(3, 2), 0.1)]
    [1, 1]
    """
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
