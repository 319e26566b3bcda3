"""When a sharded model's gradients are reduced, decided as DDP decides it (the fsdp engine's `no_sync` and
`trigger_sync_in_backward`), and the one all-reduce that averages the parameters FSDP keeps whole on every rank."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.distributed.tensor import DTensor


class GradientSync:
    """Whether a prepared model's backward syncs gradients, decided as DDP decides it: by the forward whose outputs
    the backward goes through (outside no_sync: yes), or by trigger_sync_in_backward around the backward. FSDP2
    itself reads its flag when the backward runs, so the decision is written to it as the backward starts; the
    replicated parameters' gradients are averaged in one all-reduce when it ends."""

    def __init__(self, model, replicated: list[torch.nn.Parameter], world: int, group=None):
        # world: the data-parallel ranks that average (all of `group`; None, every rank)
        self.model, self.replicated, self.world, self.group = model, replicated, world, group
        self.enabled, self.triggered = True, False
        self._pending: list[bool] = []  # the decisions of the forwards the running backward goes through
        model.register_forward_hook(self._after_forward)  # after fully_shard's, so FSDP's output hooks come first

    @contextlib.contextmanager
    def off(self):
        """no_sync: forwards in here leave their backward's gradients on this rank, to accumulate."""
        previous, self.enabled = self.enabled, False
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.enabled = previous
            self.model.set_requires_gradient_sync(previous)

    @contextlib.contextmanager
    def forced(self):
        """trigger_sync_in_backward: a backward in here syncs, whichever way its forward ran."""
        previous, self.triggered = self.triggered, True
        self.model.set_requires_gradient_sync(True)
        try:
            yield
        finally:
            self.triggered = previous
            self.model.set_requires_gradient_sync(self.enabled)

    def _after_forward(self, module, args, output):
        tensors = [t for t in _tensors_in(output) if t.requires_grad] if torch.is_grad_enabled() else []
        if tensors:
            sync = self.enabled
            torch.autograd.graph.register_multi_grad_hook(tensors, lambda grad: self._before_backward(sync), mode="any")

    def _before_backward(self, sync_at_forward: bool):
        self._pending.append(sync_at_forward or self.triggered)
        self.model.set_requires_gradient_sync(any(self._pending))  # each block reads it in its post-backward
        Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self):
        # One callback per forward the backward went through; the first does the work for all of them.
        sync, self._pending = any(self._pending), []
        trained = [p for p in self.replicated if p.requires_grad]  # the same list on every rank
        if sync and trained and self.world > 1:
            average_gradients(trained, self.world, self.group)


def average_gradients(params: list[torch.nn.Parameter], world: int, group=None):
    """DDP's average of replicated parameters' gradients: summed over ranks in ONE all-reduce (per-parameter
    collectives could pair one rank's `a` with another's `b` if their backwards ran in other orders), then divided
    by the world size. A rank without a gradient for a parameter adds zeros; one no rank has a gradient for stays
    None (a count of the ranks that had one travels with the sum). A tensor-parallel parameter (a DTensor) averages
    its own shard, over `group`: the data-parallel ranks that hold the same shard."""
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in params])
    local = [_local(p) for p in params]
    had = torch.tensor([p.grad is not None for p in params], dtype=dtype, device=local[0].device)
    flat = torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(t)).reshape(-1).to(dtype)
                      for p, t in zip(params, local)] + [had])
    dist.all_reduce(flat, group=group)
    pieces = flat.split([t.numel() for t in local] + [len(params)])
    for param, shape, summed, count in zip(params, local, pieces, pieces[-1].tolist()):
        if count:
            mean = (summed / world).view_as(shape).to(param.dtype)
            if param.grad is None:
                param.grad = mean if not isinstance(param, DTensor) else DTensor.from_local(
                    mean, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                    stride=param.stride())
            else:
                _local(param.grad).copy_(mean)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors_in(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors_in(item)]
    if isinstance(output, Mapping):  # a dict, or a transformers ModelOutput
        return [t for item in output.values() for t in _tensors_in(item)]
    return []
