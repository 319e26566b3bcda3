"""Training-state memory per rank: bytes of parameters, gradients and optimizer state under the ddp and fsdp
engines at world 2 and 4, next to the model's total.

    python benchmarks/memory.py                  # resnet18 (11.2M parameters), AdamW, worlds 2 and 4, ~1 min
    python benchmarks/memory.py --model resnet9  # another model
    python benchmarks/memory.py --quick          # tiny, about 30 s
    python benchmarks/memory.py --quick --worlds 2   # tiny, world 2 only (what tests/test_benchmarks.py runs)

For each world size W, W processes (torch.multiprocessing.spawn, gloo) build the toolkit's ddp and fsdp
engines on one group, prepare a copy of the same model with AdamW under each, and take one training step
(the optimizer creates its state on the first step). Each rank then sums the bytes of the tensors it holds:
its parameters, their .grad and the optimizer's state tensors; for a DTensor (FSDP) that is the local shard
(`to_local()`), padding included. Rank 0's totals are reported (the ranks differ by padding only).
Targets: fsdp per rank <= 0.55 x ddp at world 2 and <= 0.30 x ddp at world 4; the ratio lines print
ddp / fsdp, so each target is a least value (1 / 0.55 and 1 / 0.30). Activations and communication buffers
are not counted: they depend on the batch, not on how the state is sharded.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import common
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model

TARGETS = {2: 0.55, 4: 0.30}  # fsdp bytes per rank / ddp bytes per rank, at most
KINDS = ("parameters", "gradients", "optimizer state")


def parse_args(argv=None):
    parser = common.build_parser("memory", __doc__)
    parser.add_argument("--model", default=None, choices=sorted(MODELS), help="default resnet18; --quick: tiny")
    parser.add_argument("--worlds", default="2,4", help="world sizes to measure, from 2 and 4 (default both)")
    args = parser.parse_args(argv)
    worlds = [w.strip() for w in args.worlds.split(",") if w.strip()]
    if not worlds or any(w not in ("2", "4") for w in worlds):
        raise UserError(f"--worlds takes 2, 4 or 2,4 (got {args.worlds}).")
    args.worlds = [int(w) for w in worlds]
    args.model = args.model or ("tiny" if args.quick else "resnet18")
    return args


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: only this rank's shard is in its memory
        total += t.numel() * t.element_size()
    return total


def held(model, optimizer) -> dict:
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"parameters": local_bytes(model.parameters()), "gradients": local_bytes(p.grad for p in model.parameters()),
            "optimizer state": local_bytes(state)}


def one_step(accelerator, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()  # gradients are kept (no zero_grad): they are part of what a step holds at its peak
    return held(accelerator.unwrap_model(model), optimizer.optimizer)


def worker(rank: int, world: int, model_name: str, port: int, result_path: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from toolkit.engines.ddp import RawDDPEngine
    from toolkit.engines.fsdp import FSDPEngine
    from toolkit.launch.env import read_launch_env

    env = read_launch_env()
    ddp = RawDDPEngine(env)  # forms the group; the fsdp engine joins it
    fsdp = FSDPEngine(env)
    torch.manual_seed(0)
    base = build_model(model_name, 10)
    result = {"total": local_bytes(base.parameters()), "ddp": one_step(ddp, copy.deepcopy(base)),
              "fsdp": one_step(fsdp, copy.deepcopy(base))}
    if rank == 0:
        Path(result_path).write_text(json.dumps(result))
    ddp.end_training()


def measure(world: int, model_name: str) -> dict:
    from toolkit.launch.launcher import free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(world, model_name, free_port(), path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def mib(n: int) -> float:
    return n / 2**20


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    rows, ratios, notes = [], [], []
    for world in args.worlds:
        target = TARGETS[world]
        result = measure(world, args.model)
        sums = {engine: sum(result[engine].values()) for engine in ("ddp", "fsdp")}
        for engine in ("ddp", "fsdp"):
            rows.append([f"{engine} x {world}", *(f"{mib(result[engine][k]):.2f}" for k in KINDS),
                         f"{mib(sums[engine]):.2f}", f"{mib(result['total']):.2f}",
                         f"{sums[engine] / sums['ddp']:.3f}"])
        ratios.append(common.Ratio(f"{args.model} ddp / fsdp per rank, world {world}", sums["ddp"] / sums["fsdp"],
                                   round(1 / target, 3)))
        notes.append(f"world {world}: fsdp holds {sums['fsdp'] / sums['ddp']:.3f} x ddp's bytes per rank "
                     f"(target <= {target}).")
    columns = ["engine x world", "parameters MiB", "gradients MiB", "optimizer state MiB", "sum MiB per rank",
               "model parameters MiB (whole)", "sum / ddp's"]
    bars = common.Bars([r[0] for r in rows], [float(r[4]) for r in rows], "MiB per rank (parameters + gradients + "
                       "AdamW state)", [f"{r[6]}x" for r in rows])
    common.publish(out, "memory", f"Training-state memory per rank: ddp vs fsdp ({args.model}, AdamW)",
                   (columns, rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


if __name__ == "__main__":
    common.run_main(main)
