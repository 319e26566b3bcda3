"""Evaluation metrics that count every sample once on any world size. The recipe's loop gathers each batch's
outputs with `accelerator.gather_for_metrics` over a prepared loader (which drops the samples the sampler
repeated to even out the last batch, Accelerate's rule) and hands them to `EvalMetrics`:

    metrics = EvalMetrics(num_classes=len(classes))    # EvalMetrics() for accuracy and loss alone
    for inputs, targets in test_loader:
        metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    metrics.compute()   # {"accuracy", "loss", "count"}, with num_classes also "top5_accuracy" (5 classes or
                        # more), "per_class_accuracy" and "confusion_matrix" (rows: true class, columns: predicted)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.errors import UserError


class EvalMetrics:
    """Top-`top_k` accuracy and mean cross-entropy of a classifier's logits (batch x classes), or a next-token
    model's (batch x time x vocabulary: each sequence's tokens averaged first; sequences are of equal length, so
    that is the mean over tokens); count is the samples (or sequences). Sums in float64: the same figure
    whatever the split into ranks and batches.

    With `num_classes`, it also counts top-5 accuracy (5 classes or more), each class's accuracy (None for a class
    with no samples) and the confusion matrix, in exact integers (`ClassCounts`).

    >>> metrics = EvalMetrics()
    >>> metrics.update(torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> result = metrics.compute()
    >>> round(result["accuracy"], 4), round(result["loss"], 4), result["count"]
    (0.6667, 0.7936, 3)
    >>> metrics = EvalMetrics(num_classes=3)
    >>> metrics.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> result = metrics.compute()
    >>> result["confusion_matrix"], result["per_class_accuracy"]
    ([[1, 0, 0], [1, 1, 0], [0, 0, 0]], [1.0, 0.5, None])
    """

    def __init__(self, top_k: int = 1, *, num_classes: int | None = None):
        self.top_k, self.num_classes = top_k, num_classes
        self.hits = self.loss = 0.0
        self.count = 0
        self.by_class = None if num_classes is None else ClassCounts(num_classes)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor):
        samples, logits = len(targets), logits.float()
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        classes = logits.shape[-1]
        outside = targets[(targets < 0) | (targets >= classes)]  # -100 (cross_entropy would skip it) or past the last
        if len(outside):
            raise UserError(f"EvalMetrics got target class {int(outside[0])} for logits of {classes} classes; "
                            f"targets must be 0 to {classes - 1}.")
        loss = F.cross_entropy(logits, targets, reduction="none").view(samples, -1).double().mean(1)
        hit = (logits.topk(self.top_k, dim=-1).indices == targets[:, None]).any(-1).view(samples, -1).double().mean(1)
        self.hits += hit.sum().item()
        self.loss += loss.sum().item()
        self.count += samples
        if self.by_class is not None:
            self._update_by_class(logits, targets)

    def _update_by_class(self, logits: torch.Tensor, targets: torch.Tensor):
        if logits.shape[-1] != self.num_classes:
            raise UserError(f"EvalMetrics(num_classes={self.num_classes}) got logits of {logits.shape[-1]} classes; "
                            "pass the number of the model's outputs.")
        self.by_class.update(logits.cpu(), targets.cpu())

    def compute(self) -> dict:
        count = max(1, self.count)
        result = {"accuracy": self.hits / count, "loss": self.loss / count, "count": self.count}
        if self.by_class is None:
            return result
        result.update(self.by_class.compute())
        return result


class ClassCounts:
    """A classifier's per-class figures in exact integers, from torch's own ops: the confusion matrix (rows: true
    class, columns: the argmax; torch.bincount), each class's accuracy (None for a class with no samples) and,
    with 5 classes or more, top-5 accuracy (torch.topk). The inputs are gathered across ranks already
    (gather_for_metrics): every rank counts every sample once, and nothing is synced again. torchmetrics counts
    the same, but importing it brings scipy, matplotlib and torchvision into every rank (~1.5 s, ~100 MiB).

    >>> counts = ClassCounts(3)
    >>> counts.update(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [2.0, 0.0, 0.0]]), torch.tensor([0, 1, 1]))
    >>> counts.compute()
    {'per_class_accuracy': [1.0, 0.5, None], 'confusion_matrix': [[1, 0, 0], [1, 1, 0], [0, 0, 0]]}
    """

    def __init__(self, num_classes: int):
        self.num_classes = num_classes
        self.matrix = torch.zeros(num_classes * num_classes, dtype=torch.long)
        self.top5_hits = 0 if num_classes >= 5 else None  # top-5 of fewer classes is always 1
        self.count = 0

    def update(self, logits: torch.Tensor, targets: torch.Tensor):
        """`logits` (samples x classes) and `targets` (samples) of valid classes."""
        cells = targets * self.num_classes + logits.argmax(-1)
        self.matrix += torch.bincount(cells, minlength=self.num_classes ** 2)
        if self.top5_hits is not None:
            self.top5_hits += int((logits.topk(5, dim=-1).indices == targets[:, None]).any(-1).sum())
        self.count += len(targets)

    def compute(self) -> dict:
        matrix = self.matrix.view(self.num_classes, self.num_classes).tolist()
        result = {} if self.top5_hits is None else {"top5_accuracy": self.top5_hits / max(1, self.count)}
        result["per_class_accuracy"] = [row[i] / sum(row) if sum(row) else None for i, row in enumerate(matrix)]
        result["confusion_matrix"] = matrix
        return result
