"""A model's blocks: the units the fsdp engine shards one by one, and the ones --activation-checkpointing and
--compile treat one by one (toolkit/models/blocks.py); and how a block is checkpointed (`Checkpointed`), which the
fsdp engine also applies to the blocks an FSDP plugin's activation_checkpointing names. Light on purpose:
importing it imports no engine."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The blocks sharded one by one before the root: the model's children that hold trainable parameters,
    with containers among them (a ResNet's `stem` and `layers` Sequentials) opened one level so each residual
    block is its own unit. A model that is itself a Sequential (resnet9, tiny) has its elements as blocks.

    >>> from toolkit.models.nets import build_model
    >>> [type(m).__name__ for m in shard_units(build_model("resnet18", 10))][:5]  # the stem's ReLU has none
    ['Conv2d', 'BatchNorm2d', 'BasicBlock', 'BasicBlock', 'BasicBlock']
    >>> [type(m).__name__ for m in shard_units(build_model("tiny", 10))]
    ['Conv2d', 'Conv2d', 'Linear']
    """
    children = list(model.children())
    if not isinstance(model, _CONTAINERS):
        children = [g for c in children for g in (c.children() if isinstance(c, _CONTAINERS) else [c])]
    return [c for c in children if any(p.requires_grad for p in c.parameters())]


class Checkpointed(nn.Module):
    """Mixed into a block's class: its forward keeps only its inputs, and backward runs it again for the rest.
    Non-reentrant `torch.utils.checkpoint` (RNG restored, so dropout draws the same mask). The rerun leaves
    BatchNorm's running statistics alone: they move once per forward, as without checkpointing."""

    def forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return super().forward(*args, **kwargs)
        # Compiled, AOTAutograd makes the statistics' update part of the forward graph and reruns only the math
        # (inductor, aot_eager; the "eager" backend has no AOTAutograd and fails at the rerun's second update).
        if torch.compiler.is_compiling():
            return checkpoint(super().forward, *args, use_reentrant=False, **kwargs)
        rerun = functools.partial(_rerun_context, self)
        return checkpoint(super().forward, *args, use_reentrant=False, context_fn=rerun, **kwargs)


def _rerun_context(block):
    return contextlib.nullcontext(), _statistics_on_copies(block)


@contextlib.contextmanager
def _statistics_on_copies(block):
    # The rerun must save what the forward saved (BatchNorm saves its running statistics), so it runs with them,
    # on copies it may update and that are dropped after.
    layers = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    kept = [{name: buffer for name, buffer in m.named_buffers(recurse=False)} for m in layers]
    for layer, buffers in zip(layers, kept):
        for name, buffer in buffers.items():
            setattr(layer, name, buffer.clone())
    try:
        yield
    finally:
        for layer, buffers in zip(layers, kept):
            for name, buffer in buffers.items():
                setattr(layer, name, buffer)


@functools.cache
def _checkpointed_class(cls: type) -> type:
    # The block's own name: Accelerate's FSDP plugin picks the blocks to wrap by class name (accelerate_configs).
    return type(cls.__name__, (Checkpointed, cls), {"__qualname__": cls.__qualname__, "__module__": cls.__module__})


def checkpoint_modules(modules: list[nn.Module]) -> list[nn.Module]:
    """Checkpoint each of `modules` in place (its class gains `Checkpointed`; isinstance and names unchanged)."""
    for module in modules:
        if not isinstance(module, Checkpointed):
            module.__class__ = _checkpointed_class(type(module))
    return modules
