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

import torch
from torch import nn

from toolkit.engines.units import Checkpointed, checkpoint_modules, shard_units  # noqa: F401 (Checkpointed: here too)


def checkpointed_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks worth checkpointing: shard units with layers inside. A lone Conv2d, BatchNorm or Linear keeps
    its input either way, so checkpointing it would only add its recomputation."""
    return [unit for unit in shard_units(model) if next(unit.children(), None) is not None]


def checkpoint_blocks(model: nn.Module) -> list[nn.Module]:
    """Checkpoint each of the model's blocks in place (its class gains `Checkpointed`), and return them. Names,
    parameters and state-dict keys are unchanged."""
    return checkpoint_modules(checkpointed_blocks(model))


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
