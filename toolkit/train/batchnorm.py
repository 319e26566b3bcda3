"""The model as the image recipes' flags adapt it (`adapt_model`), and BatchNorm across ranks: `--sync-bn` as SyncBatchNorm where PyTorch runs it (GPU ranks), and on CPU ranks,
where PyTorch refuses it, the running statistics averaged over ranks before each checkpoint (an evaluation
follows one), so every rank saves and evaluates one model.
"""

from __future__ import annotations

import torch


def batchnorm_layers(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def sync_batchnorm(model, accelerator):
    """(model, fallback): SyncBatchNorm layers on several GPU ranks; fallback=True on CPU ranks, meaning "call
    `average_batchnorm_stats` before each checkpoint" (said once); (model, False) when there is nothing to sync."""
    if accelerator.num_processes == 1 or not batchnorm_layers(model):
        return model, False
    if accelerator.device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), False
    accelerator.print("[toolkit] --sync-bn: PyTorch's SyncBatchNorm needs GPUs; averaging BatchNorm "
                      "running statistics across ranks at each checkpoint and evaluation instead.")
    return model, True


@torch.no_grad()
def average_batchnorm_stats(model, accelerator):
    """Make every rank's BatchNorm running mean/var the average over ranks (every rank calls it)."""
    for layer in batchnorm_layers(accelerator.unwrap_model(model)):
        if layer.running_mean is not None:
            layer.running_mean.copy_(accelerator.reduce(layer.running_mean, "mean"))
            layer.running_var.copy_(accelerator.reduce(layer.running_var, "mean"))


def adapt_model(model, cfg, accelerator):
    """(model, whether BatchNorm statistics are averaged by hand) after --sync-bn, --channels-last, --compile."""
    model, average_bn = sync_batchnorm(model, accelerator) if cfg.sync_bn else (model, False)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return (torch.compile(model) if cfg.compile else model), average_bn
