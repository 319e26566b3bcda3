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

    With `num_classes`, torchmetrics also counts top-5 accuracy (5 classes or more), each class's accuracy (None
    for a class with no samples, where torchmetrics would say 0) and the confusion matrix, in exact integers.

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
        self.by_class = None if num_classes is None else class_metrics(num_classes)

    @torch.no_grad()
    def update(self, logits: torch.Tensor, targets: torch.Tensor):
        samples, logits = len(targets), logits.float()
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
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
        found = self.by_class.compute()
        matrix = found["confusion_matrix"].tolist()
        if "top5_accuracy" in found:
            result["top5_accuracy"] = found["top5_accuracy"].item()
        result["per_class_accuracy"] = [value if sum(row) else None
                                        for value, row in zip(found["per_class_accuracy"].tolist(), matrix)]
        result["confusion_matrix"] = matrix
        return result


def class_metrics(num_classes: int):
    """torchmetrics' per-class figures for `num_classes` classes, on CPU."""
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassAccuracy, MulticlassConfusionMatrix

    # The inputs are gathered across ranks already (gather_for_metrics): every rank holds every sample, so a
    # sync at compute would count each sample once per rank.
    local = {"num_classes": num_classes, "sync_on_compute": False}
    metrics = {"per_class_accuracy": MulticlassAccuracy(average=None, **local),
               "confusion_matrix": MulticlassConfusionMatrix(**local)}
    if num_classes >= 5:
        metrics["top5_accuracy"] = MulticlassAccuracy(top_k=5, average="micro", **local)
    return MetricCollection(metrics, compute_groups=False)
