"""Launched by the tests through every launch path: proves one process group and exact gathering.

Writes OUT (rank 0 only) as JSON: engine, world size, the all-reduce of rank ids, what
gather_for_metrics returned for a 9-sample loader with batch size 2, and whether end_training released the
prepared model's DDP wrapper from the group.
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
model = accelerator.prepare(torch.nn.Linear(2, 2))
accelerator.print(f"PROBE engine={accelerator.name} world={accelerator.num_processes}")
main, engine, world = accelerator.is_main_process, accelerator.name, accelerator.num_processes
accelerator.wait_for_everyone()
accelerator.end_training()
if main:
    with open(args.out, "w") as f:
        json.dump({
            "engine": engine,
            "launcher": env.launcher,
            "world": world,
            "rank_sum": int(rank_sum.item()),
            "gathered": gathered.tolist(),
            # A DDP wrapper still holding its reducer after end_training can abort the process at exit.
            "ddp_wrapper_released": not isinstance(model, torch.nn.parallel.DistributedDataParallel)
                                    or "reducer" not in model.__dict__,
        }, f)
