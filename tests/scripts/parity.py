"""Train a BatchNorm-free net for two epochs and save its start and final parameters and how many steps the
real torch optimizer took, once per gradient-accumulation setting (optionally with clip_grad_norm_). Run as
1 process x batch 2B and as 2 ranks x batch B: both must match tests/reference.py's hand-written loop."""
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
parser.add_argument("--grad-accum", default="1,2", help="comma-separated settings to train with; a trailing c "
                    "(2c) also clips the gradient norm to --max-norm before each step, a trailing s (2s) also "
                    "prepares a LambdaLR scheduler (0.97 ** tick) stepped after every optimizer.step() call")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--max-norm", type=float, default=0.1, help="clip_grad_norm_ to this in the settings ending in c")
parser.add_argument("--out", required=True, help="prefix: writes PREFIX-ga{G}.pt (start and final weights)")
args = parser.parse_args()

accelerator = toolkit.build_accelerator(args.engine)
generator = torch.Generator().manual_seed(1234)  # the same data on every rank
data = TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,), generator=generator))

for setting in args.grad_accum.split(","):
    grad_accum, clip, schedule = int(setting.rstrip("cs")), setting.endswith("c"), setting.endswith("s")
    accelerator.gradient_accumulation_steps = grad_accum
    accelerator.set_seed(0)  # rank 0's initial weights are the ones DDP broadcasts
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    optimizer_steps = []  # one entry per step the real torch optimizer took, whatever wraps it
    optimizer.register_step_post_hook(lambda *_: optimizer_steps.append(1))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda tick: 0.97 ** tick)) if schedule else None
    start = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    all_reduces = []  # for each gradient all-reduce DDP ran: was it an optimizer (sync) step?
    if isinstance(model, DistributedDataParallel):
        def counting_hook(state, bucket):
            all_reduces.append(accelerator.sync_gradients)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting_hook)
    for epoch in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_norm)
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()  # Accelerate's meaning: on optimizer steps only, num_processes ticks each
                optimizer.zero_grad()
    if accelerator.is_main_process:
        state = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save({"start": start, "final": state}, f"{args.out}-ga{setting}.pt")
        with open(f"{args.out}-ga{setting}.json", "w") as f:
            json.dump({"all_reduces": all_reduces, "optimizer_steps": len(optimizer_steps),
                       "last_lr": scheduler.get_last_lr()[0] if scheduler else None}, f)
    accelerator.wait_for_everyone()
accelerator.end_training()
