"""One rank's peak memory under a setup, in parts, from a one-device trace (trace.py): each part is a small
function that says where its rule comes from. The peak is the backward's (activations all kept, gradients
arriving) or the optimizer step's, whichever is larger; a pipeline's is its most loaded stage's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.plan.trace import Trace

PARTS = ("parameters", "gradients", "optimizer", "activations", "communication", "workspace")
# Styles whose layer keeps its whole (gathered) input for backward: a column-wise layer multiplies the whole
# sequence (torch's ColwiseParallel after SequenceParallel); every other split activation is 1/tp per rank.
WHOLE_INPUT_STYLES = {"colwise", "colwise_rep", "loss_parallel", "embedding", "replicate"}


@dataclass(frozen=True)
class Setup:
    """One candidate: an engine (single, dp, ddp, fsdp) or a mesh (tp, pp, fsdp with either), its processes, the
    micro-batch per process, activation checkpointing and precision. tp and pp are the mesh's sizes; the data-
    parallel ranks are the rest. `slices` is the pipeline's micro-batches per micro-step (default pp)."""
    engine: str
    processes: int
    micro_batch: int
    checkpointing: bool = False
    precision: str = "no"
    tp: int = 1
    pp: int = 1
    slices: int = 0
    schedule: str = "1f1b"

    @property
    def data_parallel(self) -> int:
        return self.processes // (self.tp * self.pp)

    @property
    def shards(self) -> int:
        """The ranks fsdp shards the training state over."""
        return self.data_parallel if self.engine.startswith("fsdp") else 1

    @property
    def pipeline_slices(self) -> int:
        return self.slices or self.pp

    def label(self) -> str:
        mesh = "x".join(f"{n}{s}" for n, s in (("dp", self.data_parallel), ("tp", self.tp), ("pp", self.pp))
                        if s > 1 and (n != "dp" or self.tp * self.pp > 1))
        engine = self.engine.split("+")[0] if self.tp * self.pp > 1 else self.engine
        return (f"{engine}{' ' + mesh if mesh else ''}" + (" gpipe" if self.pp > 1 and self.schedule == "gpipe" else "")
                + (" ckpt" if self.checkpointing else "")
                + (f" {self.precision}" if self.precision != "no" else ""))


def module_of(name: str, modules) -> bool:
    """True when parameter or module `name` lies in one of `modules` (module names)."""
    return any(name == m or name.startswith(m + ".") for m in modules)


def stage_modules(trace: Trace, setup: Setup, stage: int) -> list[str]:
    """The modules pipeline stage `stage` holds: its blocks (engines/pipeline.py's block_ranges), the embed
    modules on the first stage, the output modules on the last."""
    from toolkit.engines.pipeline import block_ranges

    parts = trace.layout["pp"]
    blocks = [parts["blocks"][i] for i in block_ranges(len(parts["blocks"]), setup.pp)[stage]]
    return blocks + (parts["embed"] if stage == 0 else []) + (parts["output"] if stage == setup.pp - 1 else [])


def held_parameters(trace: Trace, setup: Setup, stage: int = 0) -> float:
    """Parameter bytes one rank holds: a pipeline stage's own; a tensor-parallel split layer's 1/tp (its weight
    by rows or columns; a row-wise layer's bias whole), fsdp's dim-0 shard of each, ceil(rows / ranks) rows as
    FSDP2's fully_shard pads it (torch.distributed.fsdp docs), but for the scalars and tied weights the fsdp engine
    keeps whole."""
    styles = trace.layout.get("tp") or {}
    owned = stage_modules(trace, setup, stage) if setup.pp > 1 else None
    total = 0.0
    for name, nbytes in trace.params.items():
        if owned is not None and not module_of(name, owned):
            continue
        module, _, kind = name.rpartition(".")
        style = styles.get(module) if setup.tp > 1 else None
        if style and style not in ("replicate",) and not (style.startswith("rowwise") and kind == "bias"):
            nbytes /= setup.tp
        ranks = 1 if name in trace.layout.get("whole", ()) else setup.shards
        total += fsdp_share(nbytes, trace.shapes[name][0] if trace.shapes[name] else 1, ranks)
    return total


def fsdp_share(nbytes: float, rows: int, ranks: int) -> float:
    """One rank's bytes of a tensor that fsdp shards over `ranks` along dim 0: ceil(rows / ranks) of its rows."""
    return nbytes * math.ceil(rows / ranks) / rows if ranks > 1 else nbytes


def optimizer_state(trace: Trace, held: float) -> float:
    """The optimizer's state for `held` parameter bytes: the bytes torch's own optimizer kept per parameter byte
    after a step in the trace (AdamW two moments: 2; SGD with momentum: 1)."""
    return trace.state / sum(trace.params.values()) * held


def gradients(trace: Trace, setup: Setup, held: float) -> float:
    """Gradient bytes alive at the backward's peak. DDP keeps every gradient in its buckets
    (gradient_as_bucket_view, engines/ddp.py), and fsdp's sharded gradients are all there by its peak, which
    the units' buffers move to the end of backward: all of them. Elsewhere the share the trace saw arrive by
    its peak, of the held parameters."""
    if setup.tp * setup.pp == 1 and (setup.engine == "ddp" or setup.shards > 1):
        return held
    return held * trace.grads_at_peak / sum(trace.params.values())


def split_activations(trace: Trace, setup: Setup) -> float:
    """A tensor-parallel rank's activations: what column-wise layers keep (their gathered input) whole, the
    rest, temporaries included, 1/tp (heads, MLP units, sequence-parallel norms, the loss's vocabulary shards)."""
    styles = trace.layout.get("tp") or {}
    whole = sum(b for m, b in trace.saved.items() if styles.get(m) in WHOLE_INPUT_STYLES)
    return whole + (trace.activations - whole) / setup.tp


def pipeline_activations(stage_trace: Trace, setup: Setup, stage: int) -> float:
    """Stage `stage`'s activations: what its modules keep for one slice (micro-batch / slices), and the activation
    it sent or received at its cut (kept for the backward), times the slices in flight at its peak (1F1B:
    min(slices, pp - stage); GPipe: every slice; torch.distributed.pipelining), plus one slice's temporaries."""
    owned = stage_modules(stage_trace, setup, stage)
    kept = sum(b for m, b in stage_trace.saved.items() if module_of(m, owned))
    if setup.tp > 1:
        kept = split_activations(_only(stage_trace, owned), setup)
    temporaries = max(0.0, stage_trace.activations - sum(stage_trace.saved.values())) / setup.tp
    slices = setup.pipeline_slices
    flight = slices if setup.schedule == "gpipe" else min(slices, setup.pp - stage)
    cut = stage_trace.inputs.get(stage_trace.layout["pp"]["blocks"][0], 0)  # what crosses a cut, per slice
    return (kept + cut) * flight + temporaries


def _only(trace: Trace, owned: list[str]) -> Trace:
    from dataclasses import replace
    saved = {m: b for m, b in trace.saved.items() if module_of(m, owned)}
    return replace(trace, saved=saved, activations=sum(saved.values()))


def communication_buffers(trace: Trace, setup: Setup) -> float:
    """fsdp's gathered units at the backward's peak: the largest unit's whole parameters twice (the one running
    and the next, prefetched), its whole gradients, and their copy the reduce-scatter sends (FSDP2's design,
    torch.distributed.fsdp docs): four times the largest unit. Measured here on resnet18 at 2 ranks (tensors
    counted as toolkit/train/plan_check.py does): 284.4 MB against 284.1 predicted."""
    if setup.shards <= 1:
        return 0.0
    largest = max((sum(trace.params.get(n, 0) for n in unit) for unit in trace.layout["units"]), default=0)
    return 4 * largest / setup.tp


def foreach_temporaries(held: float, device_kind: str) -> float:
    """A foreach optimizer's step on a GPU (torch's default there) builds a temporary per parameter (Adam's
    sqrt of the second moment, torch/optim/adam.py _multi_tensor_adam): one copy of the held bytes. On a CPU
    torch steps parameter by parameter (foreach is for CUDA tensors)."""
    return held if device_kind == "cuda" else 0.0


def kernel_workspace(trace: Trace, device_kind: str) -> float:
    """A CPU convolution copies its input into oneDNN's blocked layout while it runs (measured here: a 3x3 conv
    over 8 channels at 1024 images holds 32 MB beyond its output, its input's size); the largest such copy sits on
    top of the activations. A GPU's cuDNN workspace is not predicted."""
    return trace.workspace if device_kind == "cpu" else 0.0


def peak_memory(at, setup: Setup, device_kind: str = "cpu") -> dict:
    """One rank's peak bytes by part (the most loaded rank's), `at(b)` the traced workload at b examples."""
    rows = []
    for stage in range(setup.pp):
        trace = at(setup.micro_batch / setup.pipeline_slices) if setup.pp > 1 else at(setup.micro_batch)
        held = held_parameters(trace, setup, stage)
        acts = (pipeline_activations(trace, setup, stage) if setup.pp > 1 else
                split_activations(trace, setup) if setup.tp > 1 else trace.activations)
        if setup.engine == "dp" and setup.processes > 1:  # DataParallel: each GPU computes its share of the batch
            acts = at(setup.micro_batch / setup.processes).activations
        parts = {"parameters": held + trace.buffers, "gradients": gradients(trace, setup, held),
                 "optimizer": optimizer_state(trace, held), "activations": acts,
                 "communication": communication_buffers(trace, setup),
                 "workspace": kernel_workspace(trace, device_kind)}
        step = foreach_temporaries(held, device_kind) + parts["optimizer"]
        if held + trace.buffers + held + step > sum(parts.values()):  # the optimizer step's peak is higher
            parts.update(gradients=held, optimizer=step, activations=0.0, communication=0.0, workspace=0.0)
        rows.append(parts)
    return max(rows, key=lambda parts: sum(parts.values()))
