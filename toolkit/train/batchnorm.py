"""The model as the recipes' flags adapt it (`adapt_model`), and BatchNorm across ranks: `--sync-bn` as
SyncBatchNorm where PyTorch runs it (GPU ranks), and on CPU ranks, where PyTorch refuses it, the running
statistics averaged over ranks before each checkpoint (an evaluation follows one), so every rank saves and
evaluates one model.
"""

from __future__ import annotations

import torch

from toolkit.engines import engine_name
from toolkit.models.blocks import checkpoint_blocks, compile_blocks


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
    for layer in batchnorm_layers(accelerator.unwrap_model(model, keep_torch_compile=False)):
        if layer.running_mean is not None:
            layer.running_mean.copy_(accelerator.reduce(layer.running_mean, "mean"))
            layer.running_var.copy_(accelerator.reduce(layer.running_var, "mean"))


def adapt_model(model, cfg, accelerator):
    """(model, whether BatchNorm statistics are averaged by hand) after --sync-bn, --channels-last,
    --activation-checkpointing and --compile, in that order: checkpointing and compiling go block by block
    (toolkit/models/blocks.py), so the fsdp engine's prepare still shards every block. DataParallel replicates
    the model each step and a replica of a compiled block would run the original's, so under dp the whole
    model is compiled (the dp engine drops that on more than one GPU, and says so)."""
    model, average_bn = sync_batchnorm(model, accelerator) if cfg.sync_bn else (model, False)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.activation_checkpointing:
        blocks = checkpoint_blocks(model)
        accelerator.print(f"[toolkit] --activation-checkpointing: {len(blocks)} blocks recompute their activations in "
                          "backward" if blocks else "[toolkit] --activation-checkpointing: the model has no blocks "
                          "with layers inside (only lone layers, which keep their inputs anyway); nothing is recomputed")
    if cfg.compile:
        model = compile_blocks(model, whole=engine_name(accelerator) == "dp")
    return model, average_bn
