"""A small training script for `toolkit parity`: an MLP (optionally with BatchNorm or dropout) trained with
SGD + momentum on fixed random data through a DataLoader the engine shards. It knows nothing about parity;
the engine records and stops it. --batch-size is per process."""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("--engine", default="auto")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--layer", choices=["none", "batchnorm", "dropout"], default="none")
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--bug-data-per-rank", action="store_true", help="a classic bug: each rank makes its own data")
args = parser.parse_args()

accelerator = toolkit.build_accelerator(args.engine)
accelerator.set_seed(0)
data_seed = 1234 + (accelerator.process_index if args.bug_data_per_rank else 0)
generator = torch.Generator().manual_seed(data_seed)  # the same data on every rank, unless the bug is asked for
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
middle = {"none": nn.Identity(), "batchnorm": nn.BatchNorm1d(16), "dropout": nn.Dropout(0.5)}[args.layer]
model = nn.Sequential(nn.Linear(8, 16), middle, nn.Tanh(), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for epoch in range(args.epochs):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
accelerator.end_training()
