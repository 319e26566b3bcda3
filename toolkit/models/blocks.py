"""What `--activation-checkpointing` and `--compile` do to a model's blocks, in torchtitan's order: checkpointing,
then compiling each block in place; the fsdp engine's `fully_shard` comes last, in `prepare`, and still finds
every block. The blocks are the units that engine shards (`shard_units`). Both keep the module tree and the
state-dict keys, so a checkpoint moves between runs with and without either flag.

    >>> from toolkit.models.nets import build_model
    >>> model = build_model("resnet18", 10)
    >>> len(checkpoint_blocks(model)), isinstance(model.layers[0], Checkpointed)  # not the stem's, head's lone layers
    (8, True)
    >>> model(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from toolkit.engines.units import shard_units


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


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks worth checkpointing: shard units with layers inside. A lone Conv2d, BatchNorm or Linear keeps
    its input either way, so checkpointing it would only add its recomputation."""
    return [unit for unit in shard_units(model) if next(unit.children(), None) is not None]


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """Checkpoint each of the model's blocks in place (its class gains `Checkpointed`), and return them. Names,
    parameters and state-dict keys are unchanged."""
    blocks = checkpointed_blocks(model)
    for block in blocks:
        if not isinstance(block, Checkpointed):
            block.__class__ = _checkpointed_class(type(block))
    return blocks


def compile_blocks(model: nn.Module, whole: bool = False, **options) -> nn.Module:
    """Compile each shard unit in place (`Module.compile`: same type, same state-dict keys), so the fsdp engine
    still shards them one by one. `whole=True`, or a model without
    units, compiles the model as one (`torch.compile`, which wraps it). Returns the model to train."""
    units = [] if whole else shard_units(model)
    if not units:
        return torch.compile(model, **options)
    for unit in units:
        unit.compile(**options)
    return model
