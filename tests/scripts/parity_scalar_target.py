"""A small training script for `toolkit parity` whose model holds parameters fully_shard cannot shard: a learned
temperature (a scalar) and two layers sharing one weight (tied across shard units). SGD + momentum on fixed
random data through a DataLoader the engine shards; it knows nothing about parity. --batch-size is per process.

    toolkit parity accelerate_configs/cpu.yaml accelerate_configs/cpu.yaml --engine-a fsdp --engine-b ddp \\
        --steps 3 -- tests/scripts/parity_scalar_target.py --batch-size 4
"""
import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import toolkit


class TemperedTied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)
        self.second.weight = self.first.weight
        self.out = nn.Linear(16, 4)
        self.temperature = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        hidden = torch.tanh(self.second(torch.tanh(self.first(torch.tanh(self.inp(x))))))
        return self.out(hidden) / self.temperature


parser = argparse.ArgumentParser()
parser.add_argument("--engine", default="auto")
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()

accelerator = toolkit.build_accelerator(args.engine)
accelerator.set_seed(0)
generator = torch.Generator().manual_seed(1234)  # the same data on every rank
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))
model = TemperedTied()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for epoch in range(args.epochs):
    for x, y in loader:
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
accelerator.end_training()
