"""Where a run's time and memory go: each optimizer step's wall time split into data wait (blocked on the loader:
`run.batches` times each fetch), compute (the rest of the step: forward, backward, the optimizer, logging; on a
CUDA device the GPU's own time for that work, from CUDA events) and, apart, checkpoint saving; the process's peak
memory; and a warning, once, when the loader holds training up.

    >>> cost = StepCost()
    >>> cost.waited(0.25); cost.step(1.0)
    {'data_s': 0.25, 'compute_s': 0.75}
    >>> cost.saved(1.0); cost.report()
    'data 12% · compute 38% · checkpoint 50%'
"""

from __future__ import annotations

import resource

import torch

DATA_BOUND_SHARE, DATA_BOUND_STEPS = 0.5, 20  # the warning: data wait over half of each of 20 steps in a row
PARTS = ("data", "compute", "checkpoint")


class StepCost:
    """Seconds per part since the start (`totals`) and since the last `report()`; `warning` is set, once, when the
    data wait exceeded DATA_BOUND_SHARE of DATA_BOUND_STEPS consecutive steps."""

    def __init__(self, device: torch.device | None = None):
        self.totals = dict.fromkeys(PARTS, 0.0)
        self._since = dict.fromkeys(PARTS, 0.0)
        self._wall = 0.0  # wall seconds since the last report: the shares' denominator
        self._waiting = 0.0  # this step's data wait so far
        self._bound_steps, self.warning, self._warned = 0, None, False
        self.device_timer = DeviceTimer() if device is not None and device.type == "cuda" else None

    def restart(self):
        """A new epoch's first step starts here: a fetch past the last one's end is not its wait."""
        self._waiting = 0.0
        if self.device_timer:  # the last epoch's final fetch started an interval: evaluation and saving ran since
            self.device_timer.discard()

    def fetching(self):
        """The loop asks the loader for the next micro-batch: the work queued for the last one ends here."""
        if self.device_timer:
            self.device_timer.stop()

    def waited(self, seconds: float):
        """Time the loop was blocked on the loader for one micro-batch of this step; its compute starts now."""
        self._waiting += seconds
        if self.device_timer:
            self.device_timer.start()

    def step(self, seconds: float) -> dict:
        """An optimizer step that took `seconds` (checkpoint saving excluded): its split, for the step's row. On a
        CUDA device compute is the GPU's time for the step's work (CUDA events; it waits for the step to finish),
        which can overlap the host's wait for data; elsewhere it is the step's wall time less that wait."""
        data = min(self._waiting, seconds)
        self._waiting = 0.0
        device_s = self.device_timer.seconds() if self.device_timer else None
        compute = seconds - data if device_s is None else device_s
        self._add("data", data)
        self._add("compute", compute)
        self._wall += seconds
        self._bound_steps = self._bound_steps + 1 if seconds > 0 and data / seconds > DATA_BOUND_SHARE else 0
        if self._bound_steps >= DATA_BOUND_STEPS and not self._warned:
            self._warned = True
            self.warning = (f"[toolkit] warning: waiting for data took over {DATA_BOUND_SHARE:.0%} of each of the last "
                            f"{DATA_BOUND_STEPS} optimizer steps: the loader holds training up; try --loader memory "
                            "(recipes/cifar.py), more --workers, or a faster disk")
        return {"data_s": round(data, 6), "compute_s": round(compute, 6)}

    def saved(self, seconds: float):
        """A checkpoint save that took `seconds`."""
        self._add("checkpoint", seconds)
        self._wall += seconds

    def _add(self, part: str, seconds: float):
        self.totals[part] += seconds
        self._since[part] += seconds

    def report(self) -> str:
        """Each part's share of the wall time since the last report, as one line's start; then counts afresh."""
        wall = self._wall
        line = " · ".join(f"{part} {self._since[part] / wall if wall else 0:.0%}" for part in PARTS)
        self._since, self._wall = dict.fromkeys(PARTS, 0.0), 0.0
        return line


class DeviceTimer:
    """The CUDA device's time for the work queued between `start()` and `stop()`, summed over intervals: a CUDA
    event is recorded at each end, and `seconds()` waits for the last one and adds up what lies between the pairs."""

    def __init__(self, event=None):
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))  # tests time a fake device
        self._intervals, self._open = [], None

    def start(self):
        self._open = self._event()
        self._open.record()

    def stop(self):
        if self._open is not None:
            end = self._event()
            end.record()
            self._intervals.append((self._open, end))
            self._open = None

    def discard(self):
        self._open = None

    def seconds(self) -> float | None:
        """The intervals' device time since the last call (None when none was timed); closes an open one."""
        self.stop()
        if not self._intervals:
            return None
        self._intervals[-1][1].synchronize()
        total = sum(start.elapsed_time(end) for start, end in self._intervals) / 1000  # elapsed_time: ms
        self._intervals = []
        return total


def seconds_since_process_start() -> float | None:
    """Wall seconds since this process started (Linux: /proc/uptime less /proc/self/stat's start time, both
    counted from boot: /proc/stat's boot time is cut to whole seconds and moves when the clock is set); None
    elsewhere."""
    import os

    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return since_boot - started_ticks / os.sysconf("SC_CLK_TCK")


def peak_memory_bytes(device: torch.device) -> int:
    """The most memory this process has held: on a GPU the tensors torch allocated there
    (torch.cuda.max_memory_allocated), elsewhere the process's peak resident set: Linux's VmHWM (this program's
    own; getrusage's ru_maxrss would carry a launcher's peak over exec), else getrusage."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # KiB on Linux, bytes on macOS


def gib(n: float) -> str:
    """
    >>> gib(3.3e9)
    '3.1 GiB'
    """
    return f"{n / 2 ** 30:.1f} GiB"


def peak_range(peaks: tuple[int, int]) -> str:
    """The ranks' (least, most) peak memory as the evaluation line shows it: one figure when they round alike."""
    shown = list(dict.fromkeys(map(gib, peaks)))
    return " to ".join(shown) + (" per rank" if len(shown) > 1 else "")


# Dense peak TFLOP/s per device for bf16/fp16 tensor-core math (fp32 in parentheses where it differs), from the
# vendors' datasheets (without sparsity). A device not listed has no MFU ("unknown") unless --peak-tflops says.
PEAK_TFLOPS = {  # name fragment (torch.cuda.get_device_name) -> (bf16/fp16, fp32)
    "H200": (989.0, 67.0), "H100": (989.0, 67.0), "A100": (312.0, 19.5), "L40S": (362.0, 91.6),
    "A10G": (70.0, 35.0), "L4": (121.0, 30.3), "V100": (125.0, 15.7), "T4": (65.0, 8.1),
}


def flops_per_sample(model: torch.nn.Module, example: torch.Tensor) -> int:
    """FLOPs of one training step's forward and backward on ONE sample, counted by torch's FlopCounterMode (matrix
    multiplies and convolutions) on `example` (a batch of one), in eval mode. The count needs shapes only, so it
    runs on meta copies of the parameters, buffers and example: no arithmetic, nothing of the model changes (a
    model that cannot run on the meta device is counted on its own tensors, its gradients then dropped). Call it
    before prepare (no collectives, no compilation).

    >>> flops_per_sample(torch.nn.Linear(8, 4), torch.zeros(1, 8))  # forward 2*8*4, the weight's gradient as many
    128
    """
    from torch.utils.flop_counter import FlopCounterMode

    def count(run) -> int:
        with FlopCounterMode(display=False) as counter:
            run().float().sum().backward()
        return int(counter.get_total_flops()) // len(example)

    training = model.training
    model.eval()
    try:
        meta = {name: torch.empty_like(tensor, device="meta").requires_grad_(tensor.requires_grad)
                for name, tensor in [*model.named_parameters(), *model.named_buffers()]}
        try:
            return count(lambda: torch.func.functional_call(model, meta, (example.to("meta"),)))
        except (RuntimeError, NotImplementedError):  # an op without a meta kernel, or a device check
            return count(lambda: model(example))
    finally:
        model.train(training)
        for parameter in model.parameters():
            parameter.grad = None


def peak_flops(device: torch.device, precision: str, override_tflops: float | None) -> float | None:
    """The device's peak FLOP/s at the run's precision: --peak-tflops when given, else PEAK_TFLOPS by name; None
    (unknown) for a CPU or an unlisted GPU."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    found = next((peaks for fragment, peaks in PEAK_TFLOPS.items() if fragment in name), None)
    return None if found is None else found[0 if precision in ("bf16", "fp16") else 1] * 1e12


def mfu(flops_per_sample: int | None, samples_per_s: float | None, world_size: int, peak: float | None) -> float | None:
    """Model FLOP utilisation: the model's FLOP rate over every process's peak; None when a figure is unknown.

    >>> mfu(600, 1e9, world_size=2, peak=1e12)
    0.3
    """
    if not (flops_per_sample and samples_per_s and peak):
        return None
    return round(flops_per_sample * samples_per_s / (peak * world_size), 4)
