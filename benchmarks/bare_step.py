"""The reference of benchmarks/startup.py: one optimizer step in plain PyTorch, no toolkit import.

    python benchmarks/bare_step.py --out first_step.json                     # one process
    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bare_step.py --out first_step.json

What a user would write by hand for the recipe's `--dataset synthetic --model tiny` run, cut at its first
step: the layers of the toolkit's `tiny` net written out, the same number and shape of synthetic images
(5,000 train and 1,000 test, 3x32x32 uint8: a smooth pattern per class, shifted and noised), SGD with
Nesterov momentum 0.9, and one step on the recipe's micro-batch (global batch 64 / world size). Under
torchrun it joins a gloo group and wraps the model in DistributedDataParallel. Once the step is done, rank 0
writes {"first_step_at": Unix time} to --out.
"""

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

GLOBAL_BATCH = 64  # images per optimizer step over all processes: the tiny preset's
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # CIFAR-10's, per channel


def synthetic_images(count: int, patterns: torch.Tensor, g: torch.Generator):
    """`count` uint8 images: each a random class's 40x40 pattern cropped at a random 32x32 window, plus noise."""
    labels = torch.randint(0, len(patterns), (count,), generator=g)
    window = torch.arange(32)
    rows = (torch.randint(0, 9, (count, 1), generator=g) + window)[:, None, :, None]
    cols = (torch.randint(0, 9, (count, 1), generator=g) + window)[:, None, None, :]
    shifted = patterns[labels[:, None, None, None], torch.arange(3)[None, :, None, None], rows, cols]
    noisy = 128 + 30 * shifted + 70 * torch.randn(shifted.shape, generator=g)
    return noisy.round().clamp(0, 255).to(torch.uint8), labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file rank 0 writes the first step's Unix time to")
    args = parser.parse_args()
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")  # env://: torchrun's MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE

    g = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.rand(10, 3, 4, 4, generator=g) * 2 - 1, size=(40, 40), mode="bilinear")
    train_x, train_y = synthetic_images(5000, patterns, g)
    synthetic_images(1000, patterns, g)  # the test split: made, as the recipe makes it, but not used here

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(16 * 8 * 8, 10),
    )
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.04, momentum=0.9, nesterov=True, weight_decay=5e-4)

    micro = GLOBAL_BATCH // world
    images = train_x[rank * micro:(rank + 1) * micro].float().div(255)
    images = (images - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    F.cross_entropy(model(images), train_y[rank * micro:(rank + 1) * micro]).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"first_step_at": time.time()}, f)
    if world > 1:
        # DDP's reducer keeps the group alive: freed only at interpreter exit, its gloo threads can abort the
        # process ("terminate called without an active exception", about one run in 25 here).
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
