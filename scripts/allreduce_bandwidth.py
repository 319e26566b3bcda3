"""Measure all-reduce latency and bandwidth between the ranks of a job, and what they predict for larger jobs.

    toolkit launch --config_file accelerate_configs/multi_node.yaml --machine_rank R --engine ddp \\
        scripts/allreduce_bandwidth.py                       # on every node
    torchrun --nproc_per_node 2 scripts/allreduce_bandwidth.py --max-mb 64

A ring all-reduce of S bytes over N ranks sends and receives 2(N-1)/N x S bytes per rank in 2(N-1) steps,
so one all-reduce takes about  t(N, S) = 2(N-1) x alpha + 2(N-1)/N x S / beta,  with alpha the per-step
latency and beta the per-link bandwidth ("bus bandwidth" in nccl-tests' terms). The script measures t for
growing S, fits alpha from the smallest message and beta from the largest, and prints t for a ResNet-18's
fp32 gradient (--grad-mb) at 8, 64 and 512 ranks with those two numbers.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist

import toolkit


def time_allreduce(tensor: torch.Tensor, repeats: int) -> float:
    """Median seconds of one all-reduce of `tensor`, after a warm-up."""
    dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # Every rank reports its time; the slowest rank is the one the step waits for.
    worst = torch.tensor(sorted(times)[len(times) // 2], device=tensor.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.item()


def ring_seconds(ranks: int, nbytes: float, alpha: float, beta: float) -> float:
    """alpha-beta model of a ring all-reduce; e.g. ring_seconds(2, 1e6, 0.0, 1e9) -> 0.001."""
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes / beta


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--max-mb", type=float, default=64.0, help="largest message, MB (doubling from 4 KB)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--grad-mb", type=float, default=44.7, help="gradient to predict for (ResNet-18 fp32: 44.7)")
    parser.add_argument("--json", help="also write the results to this file (main process)")
    args = parser.parse_args()
    accelerator = toolkit.build_accelerator("ddp")
    n = accelerator.num_processes
    if n < 2:
        raise toolkit.UserError("launch at least 2 processes: there is nothing to all-reduce between 1.")
    rows, size = [], 1024  # float32 elements: 4 KB
    while size * 4 <= args.max_mb * 1e6:
        seconds = time_allreduce(torch.ones(size, device=accelerator.device), args.repeats)
        nbytes = size * 4
        rows.append({"bytes": nbytes, "seconds": seconds, "algbw_GBps": nbytes / seconds / 1e9,
                     "busbw_GBps": 2 * (n - 1) / n * nbytes / seconds / 1e9})
        size *= 4
    alpha = rows[0]["seconds"] / (2 * (n - 1))
    beta = rows[-1]["busbw_GBps"] * 1e9
    grad = args.grad_mb * 1e6
    predicted = {ranks: ring_seconds(ranks, grad, alpha, beta) for ranks in (8, 64, 512)}
    accelerator.print(f"all-reduce over {n} ranks ({accelerator.device.type}, {dist.get_backend()}):")
    accelerator.print(f"{'bytes':>12} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for row in rows:
        accelerator.print(f"{row['bytes']:>12,} {row['seconds'] * 1e3:>9.3f} {row['algbw_GBps']:>11.3f} "
                          f"{row['busbw_GBps']:>11.3f}")
    accelerator.print(f"latency per ring step alpha = {alpha * 1e6:.0f} us; link bandwidth beta = {beta / 1e9:.3f} GB/s")
    for ranks, seconds in predicted.items():
        accelerator.print(f"predicted all-reduce of a {args.grad_mb:g} MB gradient over {ranks} ranks: "
                          f"{seconds * 1e3:.1f} ms")
    if args.json and accelerator.is_main_process:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "rows": rows, "alpha_s": alpha, "beta_Bps": beta,
                       "predicted_s": {str(k): v for k, v in predicted.items()}}, f, indent=1)
    accelerator.end_training()


if __name__ == "__main__":
    main()
