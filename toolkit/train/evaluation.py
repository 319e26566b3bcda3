"""Evaluation that counts every sample once on any world size: the loader is prepared
(`accelerator.prepare(DataLoader(...))`), each rank runs its share, and `gather_for_metrics` drops the samples
the sampler repeated to even out the last batch (Accelerate's own rule).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.no_grad()
def evaluate(model, loader, accelerator, top_k: int = 1) -> dict:
    """{"accuracy", "loss", "count"} over a prepared loader of (inputs, targets): a classifier's, or a next-token
    model's (logits over the last dimension, each sequence's tokens averaged first; sequences are of equal
    length, so that is the mean over tokens). Accuracy is top-`top_k`; count is the samples (or sequences)."""
    was_training = model.training
    model.eval()
    hits, losses = [], []
    for inputs, targets in loader:
        logits = model(inputs).float()
        samples = len(targets)  # gather_for_metrics drops padding in samples: per-sample values only
        logits, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        loss = F.cross_entropy(logits, targets, reduction="none").view(samples, -1).mean(1)
        hit = (logits.topk(top_k, dim=-1).indices == targets[:, None]).any(-1).view(samples, -1).double().mean(1)
        hit, loss = accelerator.gather_for_metrics((hit, loss))
        hits.append(hit)
        losses.append(loss.double())  # float64 sums: the same figure whatever the split into ranks
    model.train(was_training)
    hits, losses = torch.cat(hits), torch.cat(losses)
    return {"accuracy": hits.mean().item(), "loss": losses.mean().item(), "count": len(hits)}
