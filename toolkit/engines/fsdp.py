"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) over NCCL or gloo: for models that outgrow one GPU.

Each rank keeps 1/W of every parameter, of its gradient and of the optimizer state; a block's full
parameters exist only while it runs (all-gathered before its forward and backward, freed after), and
gradients are reduce-scattered instead of all-reduced. The world is formed exactly as the ddp engine
forms it; only `_wrap_model`, accumulation, clipping and state dicts differ.

    torchrun --nproc_per_node 2 recipes/cifar.py --engine fsdp
    toolkit launch --config_file accelerate_configs/cpu.yaml --engine fsdp recipes/cifar.py

The model is sharded per block (`shard_units`), then at the root. bf16 goes through FSDP's
MixedPrecisionPolicy (bf16 compute and all-gathers, fp32 gradient reduction and master weights), not
autocast. BatchNorm buffers are not sharded: like DDP, rank 0's are broadcast before each training
forward, so every rank normalises with one model's statistics and a checkpoint holds them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from toolkit.engines.prepared import PreparedOptimizer
from toolkit.engines.ddp import RawDDPEngine
from toolkit.errors import UserError

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, in CPU memory


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks sharded one by one before the root: the model's children, with containers among them
    (a ResNet's `layers` Sequential) opened one level so each residual block is its own unit. A model
    that is itself a Sequential (resnet9, tiny) has its elements as blocks.

    >>> [type(m).__name__ for m in shard_units(build_model("resnet18", 10))][:5]
    ['Conv2d', 'BatchNorm2d', 'BasicBlock', 'BasicBlock', 'BasicBlock']
    """
    children = list(model.children())
    if not isinstance(model, _CONTAINERS):
        children = [g for c in children for g in (c.children() if isinstance(c, _CONTAINERS) else [c])]
    return [c for c in children if any(p.requires_grad for p in c.parameters())]


def fsdp_modules(model):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


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
            unit.set_reshard_after_forward(True, recurse=False)
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
        by_name = {"state": {self.names[i]: value for i, value in state_dict["state"].items()},
                   "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]}
                                    for g in state_dict["param_groups"]]}
        set_optimizer_state_dict(self.model, self.optimizer, by_name, options=StateDictOptions(full_state_dict=True))


class FSDPEngine(RawDDPEngine):
    name = "fsdp"

    def __init__(self, env, **kwargs):
        super().__init__(env, **kwargs)
        self._mesh = init_device_mesh(self.device.type, (self._world,))
        self._swapped = {}  # original parameter -> its sharded replacement (optimizers built before prepare)
        self._models = []

    def prepare_model(self, model):
        # Not the base's autocast: MixedPrecisionPolicy casts the gathered parameters instead.
        return self._wrap_model(model.to(self.device))

    def _wrap_model(self, model):
        names = {p: name for name, p in model.named_parameters()}
        bf16 = self.mixed_precision == "bf16"
        dtype = torch.bfloat16 if bf16 else torch.float16 if self.mixed_precision == "fp16" else None
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                      output_dtype=torch.float32 if dtype else None)
        if self._world > 1:
            # As DDP does when it wraps: every rank starts from rank 0's weights (ranks seeded apart
            # initialise differently, and fully_shard would keep each rank's own slice of its own init).
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, src=0)
        for unit in shard_units(model):
            fully_shard(unit, mesh=self._mesh, mp_policy=policy)
        fully_shard(model, mesh=self._mesh, mp_policy=policy)
        # fully_shard replaced every parameter by a sharded one; optimizers made before must follow.
        sharded = dict(model.named_parameters())
        self._swapped.update({old: sharded[name] for old, name in names.items()})
        if self._world > 1 and any(True for _ in model.buffers()):
            model.register_forward_pre_hook(self._broadcast_buffers)
        return model

    def _broadcast_buffers(self, model, args):
        if model.training and torch.is_grad_enabled() and self.sync_gradients:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def _prepare_one(self, obj):
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, PreparedOptimizer):
            return self._prepare_optimizer(obj)
        return super()._prepare_one(obj)

    def _prepare_optimizer(self, optimizer):
        if optimizer.state:
            raise UserError("prepare the optimizer before its first step under the fsdp engine: sharding "
                            "replaces the parameters its state belongs to.")
        for group in optimizer.param_groups:
            group["params"] = [self._swapped.get(p, p) for p in group["params"]]
        first = optimizer.param_groups[0]["params"][0]
        owners = [m for m in self._models if any(p is first for p in m.parameters())]
        if not owners:
            raise UserError("prepare the model together with (or before) its optimizer under the fsdp engine.")
        prepared = FSDPOptimizer(optimizer, self, owners[0])
        self._optimizers.append(prepared)
        return prepared

    def prepare(self, *objects):
        # Models first, so an optimizer passed before its model in the same call still finds it.
        models = {id(o): self.prepare_model(o) for o in objects if isinstance(o, torch.nn.Module)}
        self._models += models.values()
        prepared = [models[id(o)] if id(o) in models else self._prepare_one(o) for o in objects]
        self._recorder.prepared(prepared)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _no_sync(self, model):
        return _gradient_sync_off(model) if isinstance(model, FSDPModule) else contextlib.nullcontext()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Clip by the norm of the FULL gradient: each rank's shard norm is combined over ranks."""
        if self.scaler is not None and self.sync_gradients:
            for optimizer in self._optimizers:
                self.scaler.unscale_(optimizer.optimizer)
        parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
        grads = [p.grad for p in parameters if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, norm_type)
        if isinstance(total, DTensor):
            total = total.full_tensor()  # the shards' norms, reduced over ranks
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def get_state_dict(self, model, unwrap: bool = True):
        """The full, unsharded state dict on the main process (a collective: call it on every rank; the
        others get an empty dict)."""
        return get_model_state_dict(self.unwrap_model(model), options=FULL)

    def load_full_state_dict(self, model, state_dict):
        """Load a full state dict (every rank holds it) into the sharded model: each keeps its shards."""
        set_model_state_dict(self.unwrap_model(model), state_dict, options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def _gradient_sync_off(model):
    # Gradients accumulate unsharded on every rank; the final micro-step reduce-scatters their sum once.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
