"""Every setup a global batch can run as, predicted, and the one to pick: the fastest whose peak fits the device
with the margin. Each (micro-batch, checkpointing, precision) is traced once; every row after
that is arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.plan.device import Device
from toolkit.plan.memory import Setup, peak_memory
from toolkit.plan.step_time import step_seconds
from toolkit.plan.trace import Traced, Workload

MARGIN = 0.10  # of the device's memory, kept free: the stated error of the peak (benchmarks/plan_accuracy.py)
# What a process holds besides its tensors, not predicted per setup: on a GPU the CUDA context and kernels
# (about 0.5 GiB, NVIDIA's CUDA docs), on a CPU torch's libraries and warmed-up kernels (measured here: 0.68 GiB
# resident after one step of a small network).
RUNTIME = {"cuda": 0.5 * 2 ** 30, "cpu": 0.68 * 2 ** 30}


@dataclass
class Row:
    setup: Setup
    accumulation: int
    memory: dict  # part -> bytes per rank
    time: dict | None  # part -> seconds per optimizer step; None when the device's speed is unknown
    fits: bool = False
    notes: list = field(default_factory=list)

    @property
    def peak(self) -> float:
        return sum(self.memory.values())

    @property
    def step(self) -> float | None:
        return sum(self.time.values()) if self.time is not None else None


class Planner:
    """Predictions for one workload on one device, each (checkpointing, precision)'s traces made once."""

    def __init__(self, workload: Workload, device: Device, margin: float = MARGIN, timed: bool = True):
        self.workload, self.device, self.margin, self.timed = workload, device, margin, timed
        self._traced = {}

    def traced(self, checkpointing: bool, precision: str) -> Traced:
        key = (checkpointing, precision)
        if key not in self._traced:
            self._traced[key] = Traced(self.workload, checkpointing, precision)
        return self._traced[key]

    def budget(self, processes_here: int) -> float:
        """Bytes one rank may hold: a GPU's memory, or the machine's shared by the processes on it, less the
        runtime and the margin."""
        memory = self.device.memory / (processes_here if self.device.shared else 1)
        return memory * (1 - self.margin) - RUNTIME[self.device.kind]

    def predict(self, setup: Setup, global_batch: int) -> Row:
        at = self.traced(setup.checkpointing, setup.precision).at
        accumulation = global_batch // (setup.data_parallel * setup.micro_batch)
        row = Row(setup, accumulation, peak_memory(at, setup, self.device.kind),
                  step_seconds(at, setup, self.device, accumulation) if self.timed else None)
        row.fits = row.peak <= self.budget(setup.processes)
        return row


def meshes(workload_layout: dict, processes: int, device: Device) -> list[Setup]:
    """The engines and meshes `processes` ranks can run (micro-batch 0: filled in later)."""
    if processes == 1:
        return [Setup("single", 1, 0)]
    found = [Setup("ddp", processes, 0), Setup("fsdp", processes, 0)]
    if device.kind == "cuda" and processes <= 8:
        found.append(Setup("dp", processes, 0))
    heads, pipeline = workload_layout.get("heads"), workload_layout.get("pp")
    can_tp = workload_layout.get("tp") is not None and heads is not None
    blocks = len(pipeline["blocks"]) if pipeline else 0
    for tp in (t for t in (2, 4, 8) if processes % t == 0):
        for pp in (p for p in (1, 2, 4) if processes % (tp * p) == 0):
            if can_tp and heads % tp == 0 and (pp == 1 or pp <= blocks):
                found.append(Setup("fsdp", processes, 0, tp=tp, pp=pp))
    for pp in (p for p in (2, 4, 8) if processes % p == 0 and p <= blocks):
        found.append(Setup("fsdp", processes, 0, pp=pp))
    return found


def micro_batches(share: int, count: int = 4) -> list[int]:
    """The largest `count` of the powers of two that divide a rank's share of the global batch, and the share.

    >>> micro_batches(96)
    [8, 16, 32, 96]
    """
    found = sorted({d for d in range(1, share + 1) if share % d == 0 and d & (d - 1) == 0} | {share})
    return found[-count:]


def candidates(planner: Planner, global_batch: int, processes: list[int], checkpointing=(False, True),
               precisions=("no",)) -> list[Row]:
    """Every candidate's row, fastest first (memory order without a step time)."""
    from dataclasses import replace

    layout = planner.traced(False, precisions[0]).at(1).layout
    rows = []
    for n in processes:
        for mesh in meshes(layout, n, planner.device):
            if global_batch % mesh.data_parallel:
                continue
            share = global_batch // mesh.data_parallel
            for micro in micro_batches(share):
                if mesh.pp > 1 and micro % mesh.pipeline_slices:
                    continue
                for ckpt in checkpointing:
                    for precision in precisions:
                        setup = replace(mesh, micro_batch=micro, checkpointing=ckpt, precision=precision)
                        rows.append(planner.predict(setup, global_batch))
    return sorted(rows, key=lambda r: (r.step if r.step is not None else 0.0, r.peak))


def recommend(rows: list[Row]) -> Row | None:
    """The fastest row that fits (the rows come fastest first)."""
    return next((row for row in rows if row.fits), None)
