"""Train a BatchNorm-free net for two epochs and save its final parameters, once per gradient-
accumulation setting. Run as 1 process x batch 2B and as 2 ranks x batch B: the results must match."""
import argparse
import json

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import toolkit

parser = argparse.ArgumentParser()
parser.add_argument("--engine", default="auto")
parser.add_argument("--batch-size", type=int, required=True)
parser.add_argument("--grad-accum", default="1,2", help="comma-separated settings to train with")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--out", required=True, help="prefix: writes PREFIX-ga{G}.pt")
args = parser.parse_args()

accelerator = toolkit.build_accelerator(args.engine)
generator = torch.Generator().manual_seed(1234)  # the same data on every rank
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))

for grad_accum in map(int, args.grad_accum.split(",")):
    accelerator.gradient_accumulation_steps = grad_accum
    accelerator.set_seed(0)  # rank 0's initial weights are the ones DDP broadcasts
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    all_reduces = []  # for each gradient all-reduce DDP ran: was it an optimizer (sync) step?
    if isinstance(model, DistributedDataParallel):
        def counting_hook(state, bucket):
            all_reduces.append(accelerator.sync_gradients)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    optimizer_steps = 0
    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                optimizer_steps += accelerator.sync_gradients
    if accelerator.is_main_process:
        state = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(state, f"{args.out}-ga{grad_accum}.pt")
        with open(f"{args.out}-ga{grad_accum}.json", "w") as f:
            json.dump({"all_reduces": all_reduces, "optimizer_steps": optimizer_steps}, f)
    accelerator.wait_for_everyone()
accelerator.end_training()
