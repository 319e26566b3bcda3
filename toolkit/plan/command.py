"""`toolkit plan`: every setup a recipe's model and global batch can run as on a device, each predicted (per-rank
peak memory and step time, in parts), what does not fit marked, and the fastest that fits recommended. Nothing
starts a process group or touches a GPU: the model runs on fake tensors.

    toolkit plan --recipe cifar --model resnet18 --global-batch-size 256          # this machine
    toolkit plan --recipe lm --model gpt-mini --device H100 --processes 1,2,4,8    # a GPU from its datasheet
    toolkit plan --recipe cifar --memory 40 --peak-tflops 150                      # a GPU given by its figures
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from toolkit.errors import UserError
from toolkit.plan import device as devices
from toolkit.plan import workloads
from toolkit.plan.memory import PARTS
from toolkit.plan.table import RUNTIME, Planner, Row, candidates, recommend

GIB = 2 ** 30


def chosen_device(args) -> devices.Device:
    if args.peak_tflops is not None and args.memory is None:
        raise UserError("--peak-tflops describes a GPU together with --memory; give both, or name a --device.")
    if args.memory is not None and args.memory <= 0:
        raise UserError(f"--memory {args.memory:g}: give the GiB one rank may hold, above 0.")
    if args.peak_tflops is not None:
        return devices.custom(args.memory, args.peak_tflops)
    if args.device == "here":
        return devices.here(args.memory * GIB if args.memory else None)
    found = devices.named(args.device)
    return found if args.memory is None else replace(found, memory=args.memory * GIB)


def world_sizes(text: str | None, device: devices.Device) -> list[int]:
    if text is None:
        return [1, 2, 4, 8] if device.kind == "cuda" else [1, 2, 4]
    try:
        sizes = sorted({int(n) for n in text.split(",")})
    except ValueError:
        raise UserError(f"--processes {text}: give world sizes separated by commas, e.g. 1,2,4.") from None
    if not sizes or sizes[0] < 1:
        raise UserError(f"--processes {text}: world sizes are 1 or more.")
    return sizes


def run_plan(args) -> int:
    started = time.perf_counter()
    work = workloads.for_recipe(args.recipe, args.model, args.optimizer, args.image_size, args.block_size)
    device = chosen_device(args)
    if not 0 <= args.margin < 1:
        raise UserError(f"--margin {args.margin:g}: give a share of the memory between 0 and 1.")
    batch = args.global_batch_size or _preset_batch(args.model or work.name.split(",")[0].split(" ")[0])
    planner = Planner(work, device, margin=args.margin)
    rows = candidates(planner, batch, world_sizes(args.processes, device),
                      precisions=("no", "bf16") if device.kind == "cuda" else ("no",))
    best = recommend(rows)
    if args.json:
        ordered = ([best] if best else []) + [r for r in rows if r is not best]
        print(json.dumps([as_dict(r) for r in ordered], indent=1))
        return 0 if best else 1
    for line in render(work, device, batch, planner, rows, best, time.perf_counter() - started):
        print(line)
    return 0 if best else 1  # nothing fits: as `toolkit env` when what it checks would stop the launch


def _preset_batch(model: str) -> int:
    from toolkit.train.presets import PRESETS

    preset = PRESETS.get(model)
    return preset.global_batch_size if preset else 256


def as_dict(row: Row) -> dict:
    s = row.setup
    return {"setup": s.label(), "engine": s.engine, "processes": s.processes, "tp": s.tp, "pp": s.pp,
            "micro_batch": s.micro_batch, "accumulation": row.accumulation, "checkpointing": s.checkpointing,
            "precision": s.precision, "peak_bytes": row.peak, "memory": row.memory, "step_s": row.step,
            "time": row.time, "fits": row.fits}


def render(work, device, batch: int, planner: Planner, rows: list[Row], best: Row | None, seconds: float) -> list:
    lines = [f"plan: {work.name} ({work.optimizer}), global batch {batch}, on {device.name}: "
             f"{device.memory / GIB:.1f} GiB{' shared by its processes' if device.shared else ' per rank'} "
             f"({device.source})",
             f"a row fits when its peak stays within the memory less {planner.margin:.0%} (the peak's stated error) "
             f"and {RUNTIME[device.kind] / GIB:.2f} GiB of runtime (torch itself)",
             f"{'setup':<24}{'procs':>5} {'micro x acc':>12} {'peak MiB':>9} ({' '.join(f'{p[:7]:>7}' for p in PARTS)})"
             f"{'step s':>10} (compute comm bubble data)  fits"]
    for row in rows:
        parts = " ".join(f"{row.memory[p] / 2 ** 20:7.1f}" for p in PARTS)
        step = (f"{row.step:10.3f} ({' '.join(f'{v:.3f}' for v in row.time.values())})" if row.time else
                f"{'?':>10}")
        s = row.setup
        lines.append(f"{s.label():<24}{s.processes:>5} {s.micro_batch:>6} x {row.accumulation:<4}"
                     f"{row.peak / 2 ** 20:>9.1f} ({parts}){step}  {'yes' if row.fits else 'NO'}")
    if best is None:
        lines.append("recommended: none: no setup fits; give more --processes, a larger --memory, or a smaller "
                     "--global-batch-size")
    else:
        s = best.setup
        lines.append(f"recommended: {s.label()} on {s.processes} process(es), micro-batch {s.micro_batch} x "
                     f"accumulation {best.accumulation}: {best.step:.3f} s per step, peak {best.peak / GIB:.2f} GiB "
                     f"per rank (the fastest of {sum(r.fits for r in rows)} that fit)")
    lines.append(f"planned {len(rows)} setups in {seconds:.1f} s")
    return lines
