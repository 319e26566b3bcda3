"""DDP communication cost: images/s of 2-rank gloo DDP divided by two processes doing the same work alone.

    python benchmarks/ddp_comm.py                       # resnet9, batch 128 per rank (the recipe's), ~3 min on 2 CPUs
    python benchmarks/ddp_comm.py --batch-size 32       # a quarter of the compute per all-reduce
    python benchmarks/ddp_comm.py --quick               # tiny, about 12 s
    python benchmarks/ddp_comm.py --bucket-cap-mb 5     # DDP's gradient bucket size (default: DDP's, 25 MiB)

Two processes (torch.multiprocessing.spawn, OMP_NUM_THREADS=1 and one torch thread each) form one gloo
group. Each holds three copies of the same model and times them in rounds, a block of steps each, started
and ended by a barrier (so a block's time is the slower rank's):
- `ddp`: DistributedDataParallel, gradients all-reduced every step;
- `ddp no_sync`: the same wrapper inside no_sync(): DDP's hooks, no communication;
- `independent`: the bare model: two processes doing the same work without ever talking.
Target: ddp / independent >= 0.95 (a full run exits 1 below it, --quick never does). DDP's logging data
(`_get_ddp_logging_data()`, sampled every step here) gives the bucket layout and how much of the
all-reduce ran while backward was still computing.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import tempfile
from pathlib import Path

import common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model

TARGET = 0.95  # DDP images/s over two independent processes'
WORLD = 2
SIDES = ("ddp", "ddp no_sync", "independent")
OVERLAP_FIELDS = ("avg_backward_compute_time", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")


def parse_args(argv=None):
    parser = common.build_parser("ddp_comm", __doc__)
    parser.add_argument("--model", default=None, choices=sorted(MODELS), help="default resnet9; --quick: tiny")
    parser.add_argument("--batch-size", type=int, default=128,
                        help="images per rank per step (default 128, the recipe's --batch-size)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket size in MiB (default: DDP's)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 16; --quick 3)")
    parser.add_argument("--block-s", type=float, default=None, help="seconds per side per round (default 1; --quick 0.3)")
    args = parser.parse_args(argv)
    args.model = args.model or ("tiny" if args.quick else "resnet9")
    args.rounds = args.rounds or (3 if args.quick else 16)
    args.block_s = args.block_s or (0.3 if args.quick else 1.0)
    if args.batch_size < 1 or args.rounds < 1 or args.block_s <= 0 or (args.bucket_cap_mb or 1) <= 0:
        raise UserError("--batch-size, --rounds, --block-s and --bucket-cap-mb must be positive.")
    return args


def train_step(model, batches, no_sync: bool = False):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    data = itertools.cycle(batches)

    def step():
        x, y = next(data)
        with model.no_sync() if no_sync else contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def agreed_calls(step, block_s: float) -> int:
    """Steps per block, the same on both ranks (DDP would hang if one rank ran a step more)."""
    calls = torch.tensor([common.calls_for(step, block_s)])
    dist.all_reduce(calls, op=dist.ReduceOp.MIN)
    return int(calls)


def measure(rank: int, args) -> dict:
    """Both ranks run this; returns the block times and rank 0's view of DDP."""
    torch.manual_seed(0)
    base = build_model(args.model, 10)
    g = torch.Generator().manual_seed(1 + rank)  # each rank its own data, as a sharded loader gives
    batches = [(torch.randn(args.batch_size, 3, 32, 32, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g))
               for _ in range(4)]
    # As the toolkit's ddp engine wraps a model: gradients are views into the communication buckets.
    ddp = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    ddp._set_ddp_runtime_logging_sample_rate(1)  # timing stats every step, not every 100th
    quiet = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb,
                                    gradient_as_bucket_view=True)
    steps = {"ddp": train_step(ddp, batches), "ddp no_sync": train_step(quiet, batches, no_sync=True),
             "independent": train_step(copy.deepcopy(base), batches)}
    for step in steps.values():  # warm-up; DDP rebuilds its buckets after the first step
        step()
        step()
    n = agreed_calls(steps["ddp"], args.block_s)

    def block(step):
        return lambda: [step() for _ in range(n)]

    times = common.time_interleaved({side: block(step) for side, step in steps.items()}, args.rounds, sync=dist.barrier)
    logged = ddp._get_ddp_logging_data()
    return {"steps": n, "times": times, "logging": {k: v for k, v in logged.items() if isinstance(v, (int, float, str))},
            "gradient_mb": sum(p.numel() * p.element_size() for p in base.parameters()) / 2**20}


def worker(rank: int, args, port: int, result_path: str):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        result = measure(rank, args)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_ranks(args) -> dict:
    from toolkit.launch.launcher import free_port

    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by both ranks: one core each
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        mp.spawn(worker, args=(args, free_port(), result_path), nprocs=WORLD, join=True)
        return json.loads(Path(result_path).read_text())


def overlap_note(logging: dict) -> str:
    """How much of the all-reduce ran while backward was still computing, from DDP's own timers."""
    if not all(field in logging for field in OVERLAP_FIELDS):
        return "this torch's DDP logging data has no backward/communication timers, so overlap was not measured."
    compute, comm, overlap = (logging[field] / 1e6 for field in OVERLAP_FIELDS)
    share = overlap / comm if comm else 0.0
    return (f"communication overlapped backward: {share:.0%} of the all-reduce time ran while backward was computing "
            f"(per step on rank 0, mean over every DDP step: backward compute {compute:.1f} ms, all-reduce "
            f"{comm:.1f} ms, overlap {overlap:.1f} ms; from DDP's _get_ddp_logging_data()).")


def report_rows(args, result: dict):
    times, n, batch = result["times"], result["steps"], args.batch_size
    rows, ratios = [], []
    for side in SIDES:
        ratio = common.Ratio(f"{side} / independent", common.paired_ratio(times, side, over="independent"),
                             TARGET if side == "ddp" else None, common.median_interval(times, side, "independent"))
        if side != "independent":
            ratios.append(ratio)
        rows.append([side, args.model, batch, common.per_second(WORLD * batch * n, times[side]), f"{ratio.value:.3f}",
                     f"{common.best_ratio(times, side, over='independent'):.3f}",
                     f">= {ratio.target:g}" if ratio.target else "", ratio.verdict])
    return rows, ratios


def bucket_note(args, result: dict) -> str:
    logging = result["logging"]
    cap = logging.get("bucket_cap_bytes", (args.bucket_cap_mb or 25) * 2**20) / 2**20
    sizes = str(logging.get("rebuilt_bucket_sizes") or logging.get("bucket_sizes", "?"))
    mib = ", ".join(f"{int(s) / 2**20:.2f}" for s in sizes.split(",") if s.strip().isdigit()) or sizes
    return (f"bucket_cap_mb {cap:g}: {result['gradient_mb']:.2f} MiB of gradients all-reduced per step "
            f"in buckets of {mib} MiB.")


def cores_note() -> str:
    cpus = os.cpu_count() or 1
    if cpus > WORLD:
        return f"{WORLD} processes x 1 thread on {cpus} CPUs: cores are left for gloo's communication threads."
    return (f"{WORLD} processes x 1 thread on {cpus} CPUs saturate the machine: gloo's communication threads "
            "take CPU time from compute instead of running beside it, so overlap cannot hide the all-reduce "
            "as it does with spare cores, or on GPUs with NCCL.")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    result = run_ranks(args)
    print(f"{args.model}: batch {args.batch_size} per rank, {result['steps']} steps per side per round, "
          f"{args.rounds} rounds, {WORLD} ranks (gloo)")
    rows, ratios = report_rows(args, result)
    notes = [bucket_note(args, result), overlap_note(result["logging"]), cores_note()]
    columns = ["side", "model", "batch per rank", "images/s, both ranks (median)", "ratio to independent (median)",
               "ratio, fastest rounds", "target", "result"]
    bars = common.Bars([r[0] for r in rows], [r[3] for r in rows], "images/s over both ranks (median over rounds)",
                       [f"{r[4]}x {r[7]}".strip() for r in rows])
    common.publish(out, "ddp_comm", f"DDP communication cost: {WORLD}-rank gloo DDP vs independent processes",
                   (columns, rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


if __name__ == "__main__":
    common.run_main(main)
