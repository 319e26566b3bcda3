"""Launched by the tests through every launch path: proves one process group and exact gathering.

Writes OUT (rank 0 only) as JSON: engine, world size, the all-reduce of rank ids, and what
gather_for_metrics returned for a 9-sample loader with batch size 2.
"""
import argparse
import json

import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("--engine", default="auto")
parser.add_argument("--out", required=True)
parser.add_argument("--accelerate-cpu-false", action="store_true", help="Accelerate's own CPU behaviour")
parser.add_argument("--local-rank", "--local_rank", type=int, help="legacy torch.distributed.launch")
args = parser.parse_args()

accelerator = toolkit.build_accelerator(args.engine, **({"cpu": False} if args.accelerate_cpu_false else {}))
rank_sum = accelerator.reduce(torch.tensor([float(accelerator.process_index)], device=accelerator.device), "sum")
loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
gathered = torch.cat([accelerator.gather_for_metrics(x) for (x,) in loader])
env = toolkit.read_launch_env()
accelerator.print(f"PROBE engine={accelerator.name} world={accelerator.num_processes}")
if accelerator.is_main_process:
    with open(args.out, "w") as f:
        json.dump({
            "engine": accelerator.name,
            "launcher": env.launcher,
            "world": accelerator.num_processes,
            "rank_sum": int(rank_sum.item()),
            "gathered": gathered.tolist(),
        }, f)
accelerator.wait_for_everyone()
accelerator.end_training()
