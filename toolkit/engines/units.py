"""A model's blocks: the units the fsdp engine shards one by one, and the ones --activation-checkpointing and
--compile treat one by one (toolkit/models/blocks.py). Light on purpose: importing it imports no engine."""

from __future__ import annotations

from torch import nn

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
