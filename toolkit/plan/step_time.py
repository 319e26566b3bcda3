"""One optimizer step's time under a setup, in parts: compute, communication not hidden by overlap, the pipeline's
bubble, and data. Each part is a small function naming its source. Collectives follow the alpha-beta model of
scripts/allreduce_bandwidth.py (alpha: a ring step's latency, beta: a link's bytes/s).
"""

from __future__ import annotations

import math

from toolkit.plan.device import Device
from toolkit.plan.memory import Setup, held_parameters, module_of, stage_modules
from toolkit.plan.trace import Trace

DDP_BUCKET = 25 * 2 ** 20  # DDP's bucket_cap_mb default (torch.nn.parallel.DistributedDataParallel)
BACKWARD_SHARE = 2 / 3  # backward's share of a step's FLOPs (twice the forward's: Kaplan et al. 2020's 6N rule)


def all_reduce_seconds(nbytes: float, ranks: int, device: Device, messages: int = 1) -> float:
    """A ring all-reduce: each rank sends and receives 2(n-1)/n of the bytes in 2(n-1) steps per message."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * device.alpha_s * messages + 2 * (ranks - 1) / ranks * nbytes / device.beta


def gather_seconds(nbytes: float, ranks: int, device: Device, messages: int = 1) -> float:
    """A ring all-gather or reduce-scatter of `nbytes` whole: (n-1)/n of them in n-1 steps per message."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * device.alpha_s * messages + (ranks - 1) / ranks * nbytes / device.beta


def kernel_seconds(trace: Trace, device: Device, precision: str, share: float = 1.0, ops: float = 1.0,
                   overhead: float | None = None) -> float:
    """One micro-step's forward and backward on one rank: FLOPs over the device's measured rate for their kind and
    width,
    bytes of the ops without FLOPs over its bandwidth, and each op's fixed cost; `share` of the work (a tensor-
    parallel rank's, a pipeline stage's) and `ops` times the ops (a pipeline stage's share, once per slice), each
    at `overhead` (default the device's plain op's)."""
    overhead = device.op_overhead_s if overhead is None else overhead
    half = precision in ("bf16", "fp16") and device.half_flops
    work = 0.0
    for key, flops in trace.flops.items():
        kind, width = key.split(":")
        work += flops / (half if half and kind == "matmul" else device.rate(kind, int(width)))
    return share * (work + trace.moved / device.bandwidth) + ops * trace.ops * overhead


def optimizer_seconds(trace: Trace, device: Device, fraction: float) -> float:
    """The optimizer step over `fraction` of the parameters: its bytes over the bandwidth, and its ops' cost."""
    return fraction * trace.step_moved / device.bandwidth + trace.step_ops * device.op_overhead_s


def work_share(trace: Trace, setup: Setup) -> float:
    """The share of the model's work one rank does per micro-step: a pipeline's slowest stage's share of the
    forward's FLOPs and bytes (its backward follows it), 1/tp of it under tensor parallelism."""
    share = 1.0
    if setup.pp > 1:
        total = sum(trace.forward.values()) or 1.0
        share = max(sum(c for m, c in trace.forward.items() if module_of(m, stage_modules(trace, setup, s)))
                    for s in range(setup.pp)) / total
    return share / setup.tp


def compute_seconds(at, setup: Setup, device: Device, accumulation: int) -> float:
    """Every micro-step's kernels on a rank slowed by the processes sharing its machine (a CPU's cores), and the
    optimizer step over the parameters it holds."""
    speed = device.share(setup.processes if device.kind == "cpu" else 1)
    trace = at(setup.micro_batch)
    held = held_parameters(trace, setup) / sum(trace.params.values())
    share = work_share(trace, setup)
    ops = share * setup.tp * setup.pipeline_slices if setup.pp > 1 else 1.0  # a stage runs its ops once per slice
    dtensor = device.dtensor_op_overhead_s or device.op_overhead_s
    kernels = kernel_seconds(trace, device, setup.precision, share, ops,
                             dtensor if setup.tp > 1 else None)  # under tp every op is a DTensor's
    return (accumulation * kernels + optimizer_seconds(trace, device, held)) / speed


def communication_seconds(at, setup: Setup, device: Device, accumulation: int) -> float:
    """Collectives per optimizer step. ddp: one all-reduce of the gradients per step (no_sync while accumulating),
    in 25 MiB buckets. fsdp: each micro-step all-gathers each unit's parameters in forward and again in backward
    (reshard_after_forward), and the step reduce-scatters the gradients. dp (one process, several GPUs): the
    parameters broadcast to the replicas and the gradients reduced back, each micro-step. tp: each sequence-
    parallel region (a module the plan gathers) all-gathers its input and reduce-scatters its output in forward,
    and the reverse in backward. pp: each slice's activation sent forward and its gradient back at every cut."""
    trace = at(setup.micro_batch)
    params = sum(trace.params.values()) / setup.tp / setup.pp
    dp, seconds = setup.data_parallel, 0.0
    if setup.engine == "ddp":
        seconds += all_reduce_seconds(params, dp, device, messages=math.ceil(params / DDP_BUCKET))
    elif setup.engine.startswith("fsdp") and dp > 1:
        units = len(trace.layout["units"]) + 1
        seconds += accumulation * 2 * gather_seconds(params, dp, device, units) + gather_seconds(params, dp, device,
                                                                                                  units)
    elif setup.engine == "dp" and setup.processes > 1:
        seconds += accumulation * 2 * params * (setup.processes - 1) / setup.processes / device.beta
    if setup.tp > 1:
        gathered = [m for m, style in (trace.layout.get("tp") or {}).items() if style == "sequence_gather"]
        region = sum(trace.inputs.get(m, 0) for m in gathered) / max(1, setup.pp)
        seconds += accumulation * 4 * gather_seconds(region, setup.tp, device, len(gathered))
    if setup.pp > 1:
        cut = trace.inputs.get(trace.layout["pp"]["blocks"][0], 0)  # a block's input: what crosses a cut
        seconds += accumulation * 2 * (device.alpha_s * setup.pipeline_slices + cut / device.beta)
    return seconds


def exposed_seconds(communication: float, compute: float, setup: Setup, device: Device) -> float:
    """The communication a step waits for. On a GPU, ddp's and fsdp's collectives run on their own stream under
    the backward's compute (hidden up to the backward's share of it); tensor- and pipeline-parallel sends sit on
    the critical path. On a CPU gloo's collectives use the same cores as the compute: nothing is hidden."""
    if device.kind != "cuda" or setup.tp * setup.pp > 1:
        return communication
    return max(0.0, communication - BACKWARD_SHARE * compute)


def bubble_seconds(compute: float, setup: Setup) -> float:
    """A pipeline's idle time: (pp - 1) slice times at the start and end of each micro-step (GPipe and 1F1B
    alike, Narayanan et al. 2021): (pp - 1) / slices of the compute."""
    return compute * (setup.pp - 1) / setup.pipeline_slices if setup.pp > 1 else 0.0


def data_seconds() -> float:
    """The recipes' loaders hold the data on the device (cifar's MemoryLoader, lm's WindowLoader) and prefetch a
    file loader's batches in workers: predicted 0. The run measures its data wait and says when it holds training
    up (toolkit/train/cost.py)."""
    return 0.0


def step_seconds(at, setup: Setup, device: Device, accumulation: int) -> dict:
    """One optimizer step's seconds by part."""
    compute = compute_seconds(at, setup, device, accumulation)
    exposed = exposed_seconds(communication_seconds(at, setup, device, accumulation), compute, setup, device)
    return {"compute": compute, "communication": exposed, "bubble": bubble_seconds(compute, setup),
            "data": data_seconds()}
