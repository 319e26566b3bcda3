"""Launched by tests/test_threads.py under 2 ranks: each rank prints the thread count build_accelerator set."""
import os

import torch

import toolkit

accelerator = toolkit.build_accelerator("ddp")
print(f"THREADS rank={accelerator.process_index} count={accelerator.threads.count} torch={torch.get_num_threads()} "
      f"cores={len(os.sched_getaffinity(0))} says={accelerator.threads}", flush=True)
accelerator.end_training()
