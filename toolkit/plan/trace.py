"""One training step of a model simulated on fake tensors (torch's FakeTensorMode: shapes and dtypes, no memory
and no arithmetic), and what it shows about one rank's memory and work:

- torch's `MemTracker` (torch.distributed._tools) splits the forward and backward's peak into parameters,
  gradients and activations; the optimizer's state and step are the recipe's own optimizer's, stepped for real on
  a small layer and scaled to the model (`optimizer_figures`);
- a dispatch counter adds up each op's FLOPs (torch.utils.flop_counter's formulas), the bytes the ops without
  FLOPs read and write, and the ops themselves;
- autograd's saved-tensor hooks say which module keeps which activation for backward, which a tensor- or
  pipeline-parallel split divides differently.

The optimizer step is not traced: MemTracker, which the issue measured right on the for-loop path, was wrong
(2.2x) on foreach's; `memory.py` adds foreach's temporaries itself. One trace per micro-batch (`Traced`).
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from toolkit.models.blocks import checkpoint_blocks
from toolkit.train.optim import build_optimizer, decay_groups

FREE_OPS = {"detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "_local_scalar_dense"}


@dataclass(frozen=True)
class Workload:
    """What a recipe trains: its model (built anew each call), a micro-batch of `b` examples (inputs, targets),
    its loss and its optimizer (`sgd` or `adamw`, toolkit.train.optim)."""
    name: str
    build: Callable[[], nn.Module]
    example: Callable[[int], tuple]
    loss: Callable
    optimizer: str
    samples: str = "samples"


@dataclass
class Trace:
    """One micro-step of `micro_batch` examples on one device, plus one optimizer step."""
    micro_batch: int
    params: dict  # name -> bytes, trainable parameters
    shapes: dict  # name -> shape
    buffers: int
    state: int  # optimizer state bytes after a step
    grads_at_peak: int  # gradient bytes alive at the step's peak (part of them: the peak is mid-backward)
    activations: int  # activations and temporaries at the peak
    saved: dict = field(default_factory=dict)  # module name -> bytes it kept for backward
    forward: dict = field(default_factory=dict)  # module name -> forward FLOPs + bytes (pipeline shares)
    flops: dict = field(default_factory=dict)  # "matmul:W"/"conv:W" -> FLOPs of forward and backward, by width
    moved: float = 0.0  # bytes read and written by ops without FLOPs, forward and backward
    ops: int = 0  # ops of forward and backward
    step_moved: float = 0.0  # the optimizer step's bytes
    step_ops: int = 0  # and ops
    inputs: dict = field(default_factory=dict)  # module name -> bytes of its forward's inputs
    layout: dict = field(default_factory=dict)  # how the model splits: `layout(model)`
    workspace: int = 0  # the largest convolution's input: the copy a CPU kernel makes of it


class _Counter(TorchDispatchMode):
    """Each op's FLOPs by kind, the bytes of ops without FLOPs, the ops, and the forward's cost by module."""

    def __init__(self, where: Callable[[], str | None]):
        super().__init__()
        self.where, self.flops, self.moved, self.ops = where, defaultdict(float), 0.0, 0
        self.forward, self.workspace = defaultdict(float), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func._overloadpacket
        if func.is_view or packet.__name__ in FREE_OPS:
            return out
        self.ops += 1
        formula = flop_registry.get(packet)
        if formula is not None:
            flops = formula(*args, **(kwargs or {}), out_val=out)
            self.flops[_kind_and_width(packet.__name__, args)] += flops
            if packet.__name__ == "convolution":  # oneDNN reorders the input to its blocked layout: a copy
                self.workspace = max(self.workspace, args[0].nbytes)
            cost = flops
        else:
            cost = sum(t.nbytes for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
            self.moved += cost
        module = self.where()
        if module is not None:
            self.forward[module] += cost
        return out


def _kind_and_width(name: str, args) -> str:
    """"conv:W" or "matmul:W": how narrow the op runs, which sets how fast a CPU runs it. A convolution's width
    is the fewer of its channels in and out (its weight's first two sizes); a multiply's the smaller of its
    inner size and its output's columns; attention's the smaller of the sequence and the head size."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if "convolution" in name:
        weight = tensors[2] if name == "convolution_backward" else tensors[1]
        return f"conv:{min(weight.shape[0], weight.shape[1])}"
    if "attention" in name:
        return f"matmul:{min(tensors[0].shape[-2], tensors[0].shape[-1])}"
    a, b = (tensors[1], tensors[2]) if name in ("addmm", "baddbmm") else (tensors[0], tensors[1])
    return f"matmul:{min(a.shape[-1], b.shape[-1])}"


@contextlib.contextmanager
def _attribution(model: nn.Module):
    """(saved bytes by module, the running module's name): global module hooks keep the stack of modules in
    forward; autograd's pack hook charges each tensor kept for backward to the innermost one, once per storage."""
    names = {id(m): name for name, m in model.named_modules()}
    stack, saved, seen, inputs = [], defaultdict(int), set(), defaultdict(int)

    def where():
        return stack[-1] if stack else None

    def pack(tensor):
        key = tensor.untyped_storage()._cdata
        if key not in seen and not isinstance(tensor, nn.Parameter) and where() is not None:
            seen.add(key)
            saved[where()] += tensor.untyped_storage().nbytes()
        return tensor
    def enter(module, args):
        if id(module) in names:
            stack.append(names[id(module)])
            inputs[names[id(module)]] += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))

    def leave(module, args, output):
        if id(module) in names and stack:
            stack.pop()
    pre = nn.modules.module.register_module_forward_pre_hook(enter)
    post = nn.modules.module.register_module_forward_hook(leave)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved, where, inputs
    finally:
        pre.remove()
        post.remove()


class _NoHook:
    def remove(self):
        pass


def _peak_tracker():
    """torch's MemTracker keeping the step's peak alone: its per-module peaks, a loop over every module at every op
    (half a trace's time), are not read here."""
    from copy import deepcopy

    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class PeakTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = deepcopy(snapshot)
    return PeakTracker()


def trace(workload: Workload, micro_batch: int, checkpointing: bool = False, precision: str = "no") -> Trace:
    """Simulate two optimizer steps of `micro_batch` examples on fake tensors and read the second."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import _MemRefType

    with FakeTensorMode():
        model = workload.build()
        if checkpointing:
            checkpoint_blocks(model)
        x, y = workload.example(micro_batch)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision in ("bf16", "fp16"))
        tracker = _peak_tracker()
        for p in model.parameters():  # a frozen parameter takes no gradient hook (MemTracker would register one)
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
        tracker.track_external(model)
        with _attribution(model) as (saved, where, inputs), tracker:
            counter = _Counter(where)
            with counter:
                with autocast:
                    loss = workload.loss(model(x), y)
                loss.backward()
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        params = {name: p.nbytes for name, p in model.named_parameters() if p.requires_grad}
        state, ops, moved = optimizer_figures(workload.optimizer)
        total = sum(params.values())
        return Trace(micro_batch=micro_batch, params=params,
                     shapes={name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad},
                     buffers=sum(b.nbytes for b in model.buffers()), state=state * total,
                     grads_at_peak=peak[_MemRefType.GRAD],
                     activations=peak[_MemRefType.ACT] + peak[_MemRefType.TEMP] + peak[_MemRefType.OTH],
                     saved=dict(saved), forward=dict(counter.forward), flops=dict(counter.flops),
                     moved=counter.moved, ops=counter.ops, step_moved=moved * total, step_ops=ops * len(params),
                     inputs=dict(inputs), layout=layout(model), workspace=counter.workspace)


@functools.cache
def optimizer_figures(name: str) -> tuple[float, float, float]:
    """(state bytes per parameter byte, ops per parameter, bytes moved per parameter byte) of one step of the
    recipe's optimizer (toolkit/train/optim.py), stepped for real on a small layer: AdamW keeps 2 bytes of state
    per byte (its two moments), SGD with momentum 1. torch steps a CPU's parameters one by one (foreach is for
    CUDA tensors), as counted here."""
    layer = nn.Linear(64, 64)
    optimizer = build_optimizer(name, decay_groups(layer, 0.0), lr=1e-3)
    for p in layer.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()  # the state is made on the first step; the second is counted
    counter = _Counter(lambda: None)
    with counter:
        optimizer.step()
    size = sum(p.nbytes for p in layer.parameters())
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.ndim)
    return state / size, counter.ops / 2, counter.moved / size


def layout(model: nn.Module) -> dict:
    """How the engines split the model, by parameter and module names: fsdp's shard units (each unit's parameter
    names, engines/units.py) and the parameters it keeps whole (engines/fsdp_parts.py), the tensor-parallel
    styles by module (engines/tensor_parallel.py) with the heads a tp size must divide, and the pipeline's parts (engines/pipeline.py): the embed and output modules and the
    blocks in order."""
    from toolkit.engines.fsdp_parts import replicated_parameters
    from toolkit.engines.tensor_parallel import _matches, heads, tp_plan
    from toolkit.engines.units import shard_units

    names = {id(m): name for name, m in model.named_modules()}
    units = [[f"{names[id(u)]}.{n}" for n, p in u.named_parameters() if p.requires_grad] for u in shard_units(model)]
    whole = list(replicated_parameters(model, shard_units(model)))  # scalars and tied weights: fsdp keeps them whole
    found = {"units": units, "whole": whole, "tp": None, "heads": heads(model), "pp": None}
    if getattr(model, "_tp_plan", None):
        found["tp"] = _matches(tp_plan(model), model)
    plan = getattr(model, "_pp_plan", None)
    if plan and isinstance(getattr(model, plan.get("blocks", ""), None), nn.ModuleList):
        count = len(getattr(model, plan["blocks"]))
        found["pp"] = {"embed": list(plan["embed"]), "output": list(plan["output"]),
                       "blocks": [f"{plan['blocks']}.{i}" for i in range(count)]}
    return found


class Traced:
    """A workload's traces by micro-batch, each made once, when first asked for (`at(b)`). A trace costs about a
    second whatever the micro-batch (fake tensors hold no data); no figure is interpolated between micro-batches,
    because where a step peaks moves with the micro-batch (the optimizer step for small ones, the start of
    backward for large)."""

    def __init__(self, workload: Workload, checkpointing: bool = False, precision: str = "no"):
        self.workload, self.checkpointing, self.precision, self._traces = workload, checkpointing, precision, {}

    def at(self, micro_batch: float) -> Trace:
        b = max(1, round(micro_batch))
        if b not in self._traces:
            self._traces[b] = trace(self.workload, b, self.checkpointing, self.precision)
        return self._traces[b]
