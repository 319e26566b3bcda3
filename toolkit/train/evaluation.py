"""Evaluation metrics that count every sample once on any world size. The recipe's loop gathers each batch's
outputs with `accelerator.gather_for_metrics` over a prepared loader (which drops the samples the sampler
repeated to even out the last batch, Accelerate's rule) and hands them to `EvalMetrics`:

    metrics = EvalMetrics()
    for inputs, targets in test_loader:
        metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    metrics.compute()   # {"accuracy", "loss", "count"}
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class EvalMetrics:
    """Top-`top_k` accuracy and mean cross-entropy of a classifier's logits (batch x classes), or a next-token
    model's (batch x time x vocabulary: each sequence's tokens averaged first; sequences are of equal length, so
    that is the mean over tokens); count is the samples (or sequences). Sums in float64: the same figure
    whatever the split into ranks and batches.

    >>> metrics = EvalMetrics()
    >>> metrics.update(torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> result = metrics.compute()
    >>> round(result["accuracy"], 4), round(result["loss"], 4), result["count"]
    (0.6667, 0.7936, 3)
    """

    def __init__(self, top_k: int = 1):
        self.top_k = top_k
        self.hits = self.loss = 0.0
        self.count = 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor):
        samples, logits = len(targets), logits.float()
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(logits, targets, reduction="none").view(samples, -1).double().mean(1)
        hit = (logits.topk(self.top_k, dim=-1).indices == targets[:, None]).any(-1).view(samples, -1).double().mean(1)
        self.hits += hit.sum().item()
        self.loss += loss.sum().item()
        self.count += samples

    def compute(self) -> dict:
        count = max(1, self.count)
        return {"accuracy": self.hits / count, "loss": self.loss / count, "count": self.count}
