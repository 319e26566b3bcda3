"""The global batch as the unit of training, as Megatron-LM and NeMo name it:

    global batch = processes x micro-batch x gradient accumulation

A recipe fixes the global batch (images per optimizer step); the launcher decides how many processes
compute it; the micro-batch (images per process per forward) caps memory; accumulation follows from the
three and is never a knob of its own. So a profile switch from 1 to 8 GPUs changes where the math runs,
not the math.

    >>> plan_batches(64, processes=2)
    BatchPlan(global_batch=64, processes=2, micro_batch=32, accumulation=1)
    >>> str(plan_batches(64, processes=1, micro_batch=16))
    '64 = 1 process(es) x micro-batch 16 x accumulation 4'
"""

from __future__ import annotations

from dataclasses import dataclass, field

from toolkit.config import listing
from toolkit.errors import UserError


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # images per optimizer step, all processes together
    processes: int
    micro_batch: int  # images per process per forward
    accumulation: int  # forwards per process per optimizer step
    why: str = field(default="", compare=False, repr=False)  # how the micro-batch was chosen (auto)

    def __str__(self) -> str:
        return (f"{self.global_batch} = {self.processes} process(es) x micro-batch {self.micro_batch} x "
                f"accumulation {self.accumulation}" + (f" ({self.why})" if self.why else ""))


def _divisors(n: int, limit: int = 64) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def plan_batches(global_batch: int, processes: int, micro_batch: int | None = None, why: str = "") -> BatchPlan:
    """Split `global_batch` over `processes`, each computing micro-batches of `micro_batch` (default: its
    whole share in one forward). A split that does not divide is refused with one sentence naming the
    process counts and micro-batches that would."""
    if global_batch < 1 or micro_batch is not None and micro_batch < 1:
        raise UserError(f"--global-batch-size and --micro-batch-size must be at least 1, not {global_batch} and "
                        f"{micro_batch}.")
    if global_batch % processes:
        below, above = global_batch // processes * processes, (global_batch // processes + 1) * processes
        raise UserError(
            f"--global-batch-size {global_batch} does not split evenly over {processes} processes; launch "
            f"{listing(_divisors(global_batch))} process(es), or with {processes} use a multiple of {processes} "
            f"such as {' or '.join(str(n) for n in (below, above) if n)}.")
    share = global_batch // processes
    micro = share if micro_batch is None else micro_batch
    if share % micro:
        raise UserError(
            f"--micro-batch-size {micro} does not divide the {share} images each of the {processes} process(es) "
            f"computes per optimizer step (global batch {global_batch}); use one of {listing(_divisors(share))}.")
    return BatchPlan(global_batch, processes, micro, share // micro, why)
