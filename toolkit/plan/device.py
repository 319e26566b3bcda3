"""The device a plan predicts for: how much memory one rank may hold, how fast it runs each kind of work, and how
fast its ranks talk. Three sources, each said in the table's header:

- this machine: measured by `measure_here()` (a few seconds of matrix multiplies, convolutions, copies and tiny
  ops at one thread and at every core, plus `scripts/allreduce_bandwidth.py` between two local processes), then
  kept in $TOOLKIT_CACHE (default ~/.cache/toolkit)/device-<cpu>.json so the next plan reads it;
- a GPU named from `toolkit.train.cost.PEAK_TFLOPS` (`--device H100`): memory and peak FLOP/s from the vendor's
  datasheet until that GPU has run once;
- `--memory GiB --peak-tflops T`: the user's own figures.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.train.cost import PEAK_TFLOPS

# Datasheet memory (GiB) of the GPUs in PEAK_TFLOPS, from the same vendors' pages.
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "A10G": 24, "L4": 24, "V100": 32, "T4": 16}
# Datasheet figures for what a GPU's table row cannot say: HBM bandwidth of an H100 SXM (3.35 TB/s) as the order of
# every listed GPU's; a CUDA kernel launch ~5 us (NVIDIA's guides); NVLink-class bus bandwidth within one node; a
# DTensor op's host-side dispatch (measured on this project's CPU: 53 us).
GPU_BANDWIDTH, GPU_OP_OVERHEAD_S, GPU_LINK, GPU_DTENSOR_OP_S = 2.0e12, 5e-6, (10e-6, 100e9), 50e-6


@dataclass(frozen=True)
class Device:
    """One rank's device. Throughputs are one process's with every core (CPU) or one whole GPU."""
    name: str
    kind: str  # "cpu" or "cuda"
    memory: float  # bytes one rank may hold
    matmul_flops: dict  # width -> FLOP/s of matrix multiplies that wide (fp32; bf16 on tensor cores: half_flops)
    conv_flops: dict  # channels -> FLOP/s of 3x3 convolutions over that many
    bandwidth: float  # bytes/s an elementwise op reads and writes
    op_overhead_s: float  # seconds each op costs whatever its size (dispatch, autograd, a kernel launch)
    alpha_s: float  # latency of one step of a ring collective
    beta: float  # bytes/s of one ring link ("bus bandwidth")
    cores: int = 1  # CPU cores the processes of one machine share
    one_thread: float = 1.0  # a process's throughput at one thread, as a share of its throughput at every core
    half_flops: float = 0.0  # bf16/fp16 matrix FLOP/s, 0 where unknown (then `matmul_flops`)
    shared: bool = False  # `memory` is the machine's, shared by the processes on it (else each rank's)
    dtensor_op_overhead_s: float = 0.0  # what an op on DTensors costs whatever its size (tensor parallel)
    source: str = ""

    def rate(self, kind: str, width: float) -> float:
        """FLOP/s of a `kind` ("matmul", "conv") op `width` wide: the measured widths' rates, interpolated in
        log-width, the narrowest's below them and the widest's above."""
        table = sorted((int(w), r) for w, r in (self.matmul_flops if kind == "matmul" else self.conv_flops).items())
        if width <= table[0][0]:
            return table[0][1]
        for (w0, r0), (w1, r1) in zip(table, table[1:]):
            if width <= w1:
                t = math.log(width / w0) / math.log(w1 / w0)
                return r0 + (r1 - r0) * t
        return table[-1][1]

    def share(self, processes_here: int) -> float:
        """A rank's share of the device's throughput when `processes_here` processes run on one machine: on a CPU
        each gets cores // processes threads (toolkit.launch.env.threads_per_process), and more processes than
        cores time-share them; a GPU is its rank's alone."""
        if self.kind != "cpu" or processes_here <= 1:
            return 1.0
        threads = max(1, self.cores // processes_here)
        at_threads = self.one_thread + (1 - self.one_thread) * (threads - 1) / max(1, self.cores - 1)
        return at_threads * min(1.0, self.cores / (processes_here * threads))


def named(name: str) -> Device:
    """A GPU from the datasheet tables: `named("H100")`."""
    key = next((k for k in PEAK_TFLOPS if k.lower() == name.lower()), None)
    if key is None:
        raise UserError(f"--device {name}: choose 'here' or one of {', '.join(PEAK_TFLOPS)}, or give --memory and "
                        "--peak-tflops.")
    half, single = PEAK_TFLOPS[key]
    return Device(name=key, kind="cuda", memory=GPU_MEMORY_GIB[key] * 2 ** 30, matmul_flops={1: single * 1e12},
                  conv_flops={1: single * 1e12}, half_flops=half * 1e12, bandwidth=GPU_BANDWIDTH,
                  op_overhead_s=GPU_OP_OVERHEAD_S, alpha_s=GPU_LINK[0], beta=GPU_LINK[1],
                  dtensor_op_overhead_s=GPU_DTENSOR_OP_S, source=f"{key} datasheet (toolkit/train/cost.py PEAK_TFLOPS, GPU_MEMORY_GIB)")


def custom(memory_gib: float, peak_tflops: float) -> Device:
    """A GPU given by its memory and peak FLOP/s (--memory, --peak-tflops); the rest as `named`'s."""
    return Device(name=f"{memory_gib:g} GiB, {peak_tflops:g} TFLOP/s", kind="cuda", memory=memory_gib * 2 ** 30,
                  matmul_flops={1: peak_tflops * 1e12}, conv_flops={1: peak_tflops * 1e12},
                  half_flops=peak_tflops * 1e12,
                  bandwidth=GPU_BANDWIDTH, op_overhead_s=GPU_OP_OVERHEAD_S, alpha_s=GPU_LINK[0], beta=GPU_LINK[1],
                  dtensor_op_overhead_s=GPU_DTENSOR_OP_S, source="--memory and --peak-tflops")


def cache_file() -> Path:
    cpu = "".join(c if c.isalnum() else "-" for c in (platform.processor() or platform.machine()))
    root = Path(os.environ.get("TOOLKIT_CACHE") or Path.home() / ".cache" / "toolkit")
    return root / f"device-{cpu}-{os.cpu_count()}.json"


def here(memory: float | None = None) -> Device:
    """This machine, from the cache, measured first when it is not there. `memory` is what one rank may hold
    (--memory); else the machine's available memory, shared by its processes."""
    path = cache_file()
    try:
        device = Device(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        device = measure_here()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(asdict(device), indent=1))
        except OSError:
            pass  # an unwritable cache: measured again next time
    return replace(device, memory=memory or available_memory(), shared=not memory)


def available_memory() -> float:
    """Linux's MemAvailable, else torch's view of nothing (0: every row then fits only under --memory)."""
    try:
        with open("/proc/meminfo") as info:
            return next(int(line.split()[1]) * 1024 for line in info if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 0.0


def _rate(work: float, run, repeats: int = 3) -> float:
    """work units per second of `run()`, the best of `repeats` after a warm-up (the least disturbed)."""
    run()
    best = min(_timed(run) for _ in range(repeats))
    return work / best


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


WIDTHS = (4, 16, 64, 256, 1024)  # channels of a convolution, inner size of a matrix multiply


def _conv(width: int):
    """A 3x3 convolution over `width` channels, forward and backward, on 16x16 maps: (FLOPs, run)."""
    images = torch.randn(max(2, 4096 // width), width, 16, 16, requires_grad=True)
    kernel = torch.randn(width, width, 3, 3, requires_grad=True)
    return 3 * 2 * images.numel() * width * 9, lambda: torch.nn.functional.conv2d(images, kernel, padding=1).sum(
        ).backward()


def _matmul(width: int):
    """A (4096 x width) @ (width x width) multiply, forward and backward: (FLOPs, run)."""
    rows, weight = torch.randn(4096, width, requires_grad=True), torch.randn(width, width, requires_grad=True)
    return 3 * 2 * 4096 * width * width, lambda: (rows @ weight).sum().backward()


def _kernels(widths=WIDTHS) -> dict:
    """This process's throughputs: convolutions and matrix multiplies at each width (a CPU runs narrow ones far
    below its peak: that is the op mix a model's FLOPs are costed by), an add over 64 MB (beyond the caches), and
    one tiny op with autograd (what each op costs whatever its size)."""
    x, y = torch.randn(16 * 2 ** 20), torch.randn(16 * 2 ** 20)
    tiny = torch.ones(4, requires_grad=True)

    def tiny_ops():  # 100 forward ops, and their backward
        z = tiny
        for _ in range(100):
            z = z * 1.0
        z.sum().backward()
    return {"matmul_flops": {w: _rate(*_matmul(w)) for w in widths},
            "conv_flops": {w: _rate(*_conv(w)) for w in widths},
            "bandwidth": _rate(3 * x.nbytes * 4, lambda: [x.add_(y) for _ in range(4)]),
            "op_overhead_s": 1 / _rate(202, tiny_ops)}


def measure_here() -> Device:
    """Measure this CPU (about 10 s): kernels at every core and at one thread, and the ring's alpha and beta."""
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    try:
        torch.set_num_threads(cores)
        every = _kernels()
        torch.set_num_threads(1)
        one = _kernels((256,))
    finally:
        torch.set_num_threads(threads)
    alpha, beta = measure_link()
    every["dtensor_op_overhead_s"] = dtensor_overhead()
    name = platform.processor() or platform.machine()
    return Device(name=f"this machine ({cores} cores)", kind="cpu", memory=0.0, **every, alpha_s=alpha, beta=beta,
                  cores=cores, one_thread=one["matmul_flops"][256] / every["matmul_flops"][256],
                  source=f"measured here on {name} at {time.strftime('%Y-%m-%d')}, cached in {cache_file()}")


def dtensor_overhead() -> float:
    """Seconds per op on a DTensor (sharding propagation runs in Python for each op), timed in this process over
    a fake process group of 2 (torch's testing backend: no peer, no communication)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # not inside a run: its own group stands
        return 0.0
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = distribute_tensor(torch.ones(8, 4), init_device_mesh("cpu", (2,)), [Shard(0)]).requires_grad_()

        def ops():  # 100 forward ops, and their backward
            z = x
            for _ in range(100):
                z = z * 1.0
            z.sum().backward()
        return 1 / _rate(202, ops)
    finally:
        dist.destroy_process_group()


def measure_link() -> tuple[float, float]:
    """(alpha, beta) of a ring between two local processes: scripts/allreduce_bandwidth.py's timings, fitted by
    least squares to t = 2(n-1) alpha + 2(n-1)/n S / beta over every message size it ran."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "allreduce_bandwidth.py"
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "link.json"
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(script), "--max-mb", "16", "--repeats", "5", "--json", str(out)],
                       capture_output=True, timeout=300, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        found = json.loads(out.read_text())
    n = found["ranks"]
    xs = [(2 * (n - 1), 2 * (n - 1) / n * row["bytes"]) for row in found["rows"]]
    ts = [row["seconds"] for row in found["rows"]]
    solution = torch.linalg.lstsq(torch.tensor(xs, dtype=torch.float64),
                                  torch.tensor(ts, dtype=torch.float64).unsqueeze(1)).solution.flatten().tolist()
    alpha, inverse_beta = max(solution[0], 1e-6), max(solution[1], 1e-12)
    return alpha, 1 / inverse_beta
