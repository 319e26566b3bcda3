"""Parts of the fsdp engine (engines/fsdp.py): which parameters FSDP must keep whole, the units of a sharded model
and keeping them unsharded, and the prepared optimizer of a sharded model, whose state dict is the full one."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from toolkit.engines.prepared import PreparedOptimizer

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, in CPU memory


def replicated_parameters(model: torch.nn.Module, units: list[torch.nn.Module]) -> dict[str, torch.nn.Parameter]:
    """The parameters fully_shard must leave whole (`ignored_params`), by name in the model's order: scalars (a 0-dim
    tensor has no dimension to split) and parameters that more than one unit uses, the root counting as one
    (each unit's fully_shard would replace a tied weight by a shard of its own, untying it). A parameter belongs
    to the innermost unit around the module that registers it, so nested units (size-based wrapping) share none.

    >>> lm = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 4), "head": torch.nn.Linear(4, 5)})
    >>> lm.head.weight = lm.embed.weight
    >>> lm.temperature = torch.nn.Parameter(torch.tensor(1.0))
    >>> from toolkit.engines.units import shard_units
    >>> list(replicated_parameters(lm, shard_units(lm)))
    ['temperature', 'embed.weight']
    """
    unit_ids = {id(unit) for unit in units}
    # Every place a unit is registered, longest (innermost) first: a module's owner is the first that prefixes it.
    prefixes = sorted((name + "." for name, m in model.named_modules(remove_duplicate=False) if id(m) in unit_ids),
                      key=len, reverse=True)
    owners: dict[torch.nn.Parameter, set[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        owner = next((p for p in prefixes if (module_name + ".").startswith(p)), "")
        for _, param in module.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(param, set()).add(owner)
    return {name: p for name, p in model.named_parameters() if p.ndim == 0 or len(owners.get(p, ())) > 1}


def gradient_norm(grads: list[torch.Tensor], norm_type) -> torch.Tensor:
    """The norm of gradients on one mesh, or whole ones: a sharded gradient's (a DTensor's) is reduced over every
    rank that holds a shard of it (DTensor's reduction, whichever mesh dimensions those are)."""
    norm = torch.nn.utils.get_total_norm(grads, norm_type)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def fsdp_modules(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


# Each unit's reshard_after_forward, for full_parameters to put back (FSDP2 has no getter).
_RESHARD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def full_parameters(model):
    """Keep every block of an FSDP model unsharded until exit, so forwards run without collectives: a rank
    may then evaluate more batches than its peers (exact evaluation over uneven shards). No-op otherwise."""
    units = fsdp_modules(model)
    for unit in units:
        unit.unshard()
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.set_reshard_after_forward(_RESHARD.get(unit, True), recurse=False)
            unit.reshard()


class FSDPOptimizer(PreparedOptimizer):
    """The optimizer of a sharded model. Its state dict is the FULL one, in torch's usual layout (state keyed
    by parameter index), so a checkpoint from fsdp resumes under ddp or single and back. Both calls are
    collectives: every rank calls them; only the main process receives the state."""

    def __init__(self, optimizer, engine, model):
        super().__init__(optimizer, engine)
        self.model = model
        names = {p: name for name, p in model.named_parameters()}
        self.names = [names[p] for group in optimizer.param_groups for p in group["params"]]

    def state_dict(self):
        full = get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        if not self.engine.is_main_process:
            return {}
        index = {name: i for i, name in enumerate(self.names)}
        return {"state": {index[name]: value for name, value in full["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_state_dict(self, state_dict):
        if not state_dict["state"]:
            # No per-parameter state (SGD without momentum): nothing is sharded, and torch's full-state load
            # cannot place what has no tensor ("Expected device to be set"). The groups' settings load as is.
            self.optimizer.load_state_dict(state_dict)
            return
        by_name = {"state": {self.names[i]: value for i, value in state_dict["state"].items()},
                   "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                    for g in state_dict["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True))
