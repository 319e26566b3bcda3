"""The run checks its plan (toolkit/plan/forecast.py): after the first evaluation the evaluation line and
summary.json show the predicted per-rank peak and step time against the measured ones, and a miss beyond the
plan's stated error is said in one line, once.

What is measured: the step time is the median optimizer step of this attempt after its first. The peak on a GPU
is torch.cuda.max_memory_allocated (the tensors torch allocated), as the evaluation line's own figure. On a CPU the
process's resident peak mixes in what glibc keeps after a free and the libraries the engines load, so the tensors
are counted instead, over the attempt's second optimizer step (`LiveTensors`): what the step starts with (the
parameters, buffers and optimizer state the run holds, and DDP's gradient buckets) plus every storage an op
creates while it lives. A compiled model is not counted (a dispatch mode would change what it compiles).
"""

from __future__ import annotations

import functools
import statistics
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

GIB = 2 ** 30


class LiveTensors(TorchDispatchMode):
    """The most bytes of tensor storage alive at once while active: `held` to start with, plus each storage an op
    returns, from its creation until it is freed (a weak reference's callback)."""

    def __init__(self, held: int):
        super().__init__()
        self.live = self.peak = held
        self._seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor holds its local shard
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key not in self._seen:
                    size = storage.nbytes()
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    self._seen[key] = weakref.ref(storage, functools.partial(self._freed, key, size))
        return out

    def _freed(self, key, size, _):
        self.live -= size
        self._seen.pop(key, None)


def held_bytes(accelerator) -> int:
    """Bytes of the storages the prepared models and optimizers hold (a DTensor's local shard), each once, and
    the gradient buckets of a DDP-wrapped model."""
    seen, total = set(), 0
    tensors = []
    for model in getattr(accelerator, "_models", []):
        tensors += [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
        logging = getattr(model, "_get_ddp_logging_data", None)
        if logging is not None:
            total += sum(int(size) for size in str(logging().get("bucket_sizes", "")).split(",") if size.strip())
    for optimizer in getattr(accelerator, "_optimizers", []):
        inner = getattr(optimizer, "optimizer", optimizer)
        tensors += [t for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


class PlanCheck:
    """Holds the forecast, counts the CPU step, and reports predicted against measured."""

    def __init__(self, forecast, accelerator, compiled: bool):
        self.forecast, self.accelerator = forecast, accelerator
        self.counting = forecast is not None and forecast.peak is not None and accelerator.device.type == "cpu" \
            and not compiled
        self.tracker, self.counted, self.steps, self.reported = None, None, [], None

    def step_starts(self, steps_this_attempt: int):
        """The first micro-batch of an optimizer step is handed out: the attempt's second step is counted."""
        if self.counting and steps_this_attempt == 1 and self.tracker is None and self.counted is None:
            self.tracker = LiveTensors(held_bytes(self.accelerator))
            self.tracker.__enter__()

    def step_done(self, seconds: float):
        self.steps.append(seconds)
        self.stop()

    def stop(self):
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self.counted, self.tracker = self.tracker.peak, None

    def measured_peak(self) -> float | None:
        """The largest rank's measured peak (a collective: every rank calls it)."""
        accelerator = self.accelerator
        if accelerator.device.type == "cuda":
            mine = torch.cuda.max_memory_allocated(accelerator.device)
        else:
            mine = -1 if self.counted is None else self.counted
        value = accelerator.gather(torch.tensor([float(mine)], device=accelerator.device)).max().item()
        return None if value < 0 else value

    def evaluated(self) -> tuple[str, str | None]:
        """(the evaluation line's clause, the miss line or None), at the first evaluation; ("", None) after."""
        if self.forecast is None or self.forecast.peak is None or self.reported is not None:
            return "", None
        peak = self.measured_peak()
        step = statistics.median(self.steps[1:]) if len(self.steps) > 1 else None
        f, tensors = self.forecast, self.accelerator.device.type == "cpu"
        self.reported = {"measured_peak_bytes": peak, "measured_step_s": step, **f.summary()}
        predicted = f.peak - (f.workspace if tensors else 0.0)  # a CPU's count is of torch's tensors
        clause = f" · plan: peak {predicted / GIB:.3f} GiB predicted" + (" in tensors" if tensors else "") + (
            f", {peak / GIB:.3f} measured ({peak / predicted - 1:+.0%})" if peak else ", not measured")
        if f.step is not None:
            clause += f"; step {f.step:.3f} s predicted" + (
                f", {step:.3f} measured ({step / f.step - 1:+.0%})" if step else ", not measured yet")
        misses, miss = [], None
        if peak and f.peak_missed(peak, tensors):
            misses.append(f"peak memory {peak / predicted - 1:+.0%}")
        if step and f.step and f.step_missed(step):
            misses.append(f"step time {step / f.step - 1:+.0%}")
        if misses:
            miss = (f"[toolkit] the plan missed: measured against predicted, {' and '.join(misses)}, beyond its "
                    f"stated ±{f.peak_error:.0%} (peak) and ±{f.step_error:.0%} (step); benchmarks/"
                    f"plan_accuracy.py measures where it stands")
        return clause, miss

    def summary(self) -> dict | None:
        if self.forecast is None or self.forecast.peak is None:
            return None
        return self.reported or self.forecast.summary()
