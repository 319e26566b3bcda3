"""A run's plan for itself: the setup it runs as (read from the accelerator), the device it runs on, with
--micro-batch-size auto the largest micro-batch predicted to fit, and the peak and step time it predicts, which
the run checks after its first evaluation (toolkit/train/run.py).

    forecast = plan_run(cfg, accelerator, workload)      # before the model is built; the same on every rank
    plan = plan_batches(cfg.global_batch_size, accelerator.data_parallel_size, forecast.micro_batch)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from toolkit.engines import engine_name, mesh_sizes
from toolkit.errors import UserError
from toolkit.plan import device as devices
from toolkit.plan.memory import Setup
from toolkit.plan.table import Planner, micro_batches

GIB = 2 ** 30
# The stated errors a run checks its plan against: the bounds, which benchmarks/plan_accuracy.py measures
# the plan within on this CPU (its figures are in benchmarks/README.md). Below the floors a difference is not a
# miss: the tiny net's measured peaks sit up to 6 MB off any prediction (allocations outside the model's tensors),
# and a recipe's own loop (logging, the schedule, the progress bar) adds about 10 ms to each step.
PEAK_ERROR, STEP_ERROR, PEAK_FLOOR, STEP_FLOOR = 0.20, 0.20, 64 * 2 ** 20, 0.05


@dataclass
class Forecast:
    micro_batch: int | None  # what the run computes per process per forward (None: the plan's default, all)
    peak: float | None = None  # predicted bytes per rank, the most loaded rank's
    step: float | None = None  # predicted seconds per optimizer step
    said: str = ""  # the start line's clause on the plan
    workspace: float = 0.0  # of `peak`: a CPU kernel's copies, outside torch's tensors (memory.kernel_workspace)
    peak_error: float = PEAK_ERROR
    step_error: float = STEP_ERROR

    def summary(self) -> dict:
        return {"predicted_peak_bytes": self.peak, "predicted_workspace_bytes": self.workspace,
                "predicted_step_s": self.step, "peak_error": self.peak_error, "step_error": self.step_error}

    def peak_missed(self, measured: float, tensors_only: bool) -> bool:
        """`measured` beyond the stated error and the floor; `tensors_only`: a count of torch's tensors, which a
        CPU kernel's copies are not in."""
        predicted = self.peak - (self.workspace if tensors_only else 0.0)
        return abs(measured - predicted) > max(PEAK_FLOOR, self.peak_error * predicted)

    def step_missed(self, measured: float) -> bool:
        return abs(measured - self.step) > max(STEP_FLOOR, self.step_error * self.step)


def run_setup(cfg, accelerator, micro_batch: int) -> Setup:
    """The setup this run is: its engine (Accelerate's own Accelerator as ddp or one process), processes, mesh,
    checkpointing and precision."""
    engine = engine_name(accelerator)
    processes = accelerator.num_processes
    if engine == "accelerate":
        engine = "ddp" if processes > 1 else "single"
    sizes = mesh_sizes(accelerator) or {}
    config = getattr(accelerator, "parallelism_config", None)
    return Setup(engine, processes, micro_batch, bool(getattr(cfg, "activation_checkpointing", False)),
                 str(accelerator.mixed_precision or "no"), tp=sizes.get("tp", 1), pp=sizes.get("pp", 1),
                 slices=getattr(config, "pp_microbatches", 0) or 0, schedule=getattr(config, "pp_schedule", "1f1b"))


def run_device(cfg, accelerator) -> devices.Device:
    """This run's device: a GPU from its name (datasheet) or --peak-tflops, this CPU as `toolkit plan` measured it
    (never measured inside a run: without the cache the step time is not predicted). Memory: --memory per rank,
    else the GPU's, else the machine's available memory shared by its processes."""
    memory = getattr(cfg, "memory", None)
    memory = memory * GIB if memory else None
    if accelerator.device.type == "cuda":
        total = torch.cuda.get_device_properties(accelerator.device).total_memory
        name = torch.cuda.get_device_name(accelerator.device)
        tflops = getattr(cfg, "peak_tflops", None)
        found = (devices.custom(total / GIB, tflops) if tflops else
                 next((devices.named(k) for k in devices.GPU_MEMORY_GIB if k in name), None))
        if found is None:
            return _unmeasured(name, "cuda", memory or total, shared=False)
        return replace(found, memory=memory or total, name=name)
    if devices.cache_file().is_file():
        return devices.here(memory)
    return _unmeasured("this machine", "cpu", memory or devices.available_memory(), shared=not memory)


def _unmeasured(name: str, kind: str, memory: float, shared: bool) -> devices.Device:
    """A device whose speed is unknown: its memory alone (no step time is predicted)."""
    return devices.Device(name=name, kind=kind, memory=memory, matmul_flops={}, conv_flops={}, bandwidth=0.0,
                          op_overhead_s=0.0, alpha_s=0.0, beta=0.0, shared=shared,
                          source="speed not measured (run `toolkit plan` once on this machine)")


def plan_run(cfg, accelerator, workload) -> Forecast:
    """The run's forecast; with --micro-batch-size auto, the largest micro-batch (a power of two dividing the
    rank's share of the global batch, or the share) whose predicted peak fits the device with the margin."""
    asked = cfg.micro_batch_size
    try:
        device = run_device(cfg, accelerator)
        planner = Planner(workload, device, timed=bool(device.matmul_flops))
        share = max(1, cfg.global_batch_size // accelerator.data_parallel_size)
        if asked != "auto":
            if asked is not None and asked < 1:
                return Forecast(asked)  # plan_batches says what is wrong with it
            row = planner.predict(run_setup(cfg, accelerator, asked or share), cfg.global_batch_size)
            return Forecast(asked, row.peak, row.step, workspace=row.memory["workspace"])
    except Exception as error:  # a model the fake tensors cannot run: the run goes on unpredicted, and says so
        if asked == "auto":
            raise UserError(f"--micro-batch-size auto cannot predict this model's memory ({type(error).__name__}: "
                            f"{str(error).splitlines()[0][:200]}); give --micro-batch-size N.") from None
        return Forecast(asked, said=f"the plan could not simulate this model: {type(error).__name__}")
    budget = planner.budget(int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes)))
    tried = []
    for micro in reversed(micro_batches(share, count=64)):
        setup = run_setup(cfg, accelerator, micro)
        if setup.pp > 1 and micro % setup.pipeline_slices:
            continue
        row = planner.predict(setup, cfg.global_batch_size)
        tried.append((micro, row.peak))
        if row.peak <= budget:
            larger = f"; {tried[-2][0]} would need {tried[-2][1] / GIB:.2f}" if len(tried) > 1 else ""
            return Forecast(micro, row.peak, row.step, workspace=row.memory["workspace"], said=
                            f"--micro-batch-size auto: {micro}, predicted peak {row.peak / GIB:.2f} GiB per rank "
                            f"within "
                            f"{budget / GIB:.2f} GiB ({device.memory / GIB:.1f} GiB less {planner.margin:.0%} and "
                            f"the runtime){larger}")
    raise UserError(f"--micro-batch-size auto: even micro-batch {tried[-1][0] if tried else 1} is predicted to need "
                    f"{tried[-1][1] / GIB:.2f} GiB per rank, over the {budget / GIB:.2f} GiB this device leaves; "
                    "give more --memory, more processes, or --activation-checkpointing.")
