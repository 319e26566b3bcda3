"""The engine contract, exercised in one process for the engine named on the command line.
Prints `CONTRACT OK <engine>` when every check passed (an AssertionError otherwise)."""
import contextlib
import io
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

engine_name = sys.argv[1]
accelerator = toolkit.build_accelerator(engine_name, gradient_accumulation_steps=2)
assert accelerator.name == engine_name
assert (accelerator.process_index, accelerator.local_process_index, accelerator.num_processes) == (0, 0, 1)
assert accelerator.is_main_process and accelerator.is_local_main_process
assert isinstance(accelerator.device, torch.device)
accelerator.set_seed(0)

# prepare: any order, same order back, each object of the kind it was.
model = torch.nn.Linear(4, 1)
reference = torch.nn.Linear(4, 1)
reference.load_state_dict(model.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
loader = DataLoader(data, batch_size=2)
scheduler, loader, model, optimizer = accelerator.prepare(scheduler, loader, model, optimizer)
assert isinstance(model, torch.nn.Module) and isinstance(optimizer, torch.optim.Optimizer)
assert hasattr(scheduler, "step") and len(loader) == 4
unwrapped = accelerator.unwrap_model(model)
# fully_shard swaps the class in place for a subclass (FSDPLinear); every other engine hands back the module.
assert type(unwrapped) is torch.nn.Linear or engine_name == "fsdp" and isinstance(unwrapped, torch.nn.Linear)

# accumulate: no optimizer step on the first micro-step, one step on the second equal to one big batch.
weights = []
for i, (x, y) in enumerate(loader):
    if i == 2:
        break
    with accelerator.accumulate(model):
        with accelerator.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    # get_state_dict: the full (unsharded) weights, whatever the engine holds per rank.
    weights.append(accelerator.get_state_dict(model)["weight"].detach().clone())
    assert accelerator.sync_gradients == (i == 1)
assert torch.equal(weights[0], reference.weight), "the first micro-step must not step the optimizer"
x4, y4 = data.tensors[0][:4], data.tensors[1][:4]
torch.nn.functional.mse_loss(reference(x4), y4).backward()
with torch.no_grad():
    expected = reference.weight - 0.1 * reference.weight.grad
assert torch.allclose(weights[1], expected, atol=1e-6), "two micro-steps must equal one step on both batches"
assert abs(optimizer.param_groups[0]["lr"] - 0.05) < 1e-9, "the scheduler steps once per optimizer step"

# collectives with one process, and exact gathering.
value = torch.tensor([3.0], device=accelerator.device)
assert torch.equal(accelerator.reduce(value, "sum"), value) and torch.equal(accelerator.reduce(value, "mean"), value)
eval_loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
gathered = torch.cat([accelerator.gather_for_metrics(x) for (x,) in eval_loader])
assert sorted(gathered.tolist()) == list(range(9)), gathered

buffer = io.StringIO()
with contextlib.redirect_stdout(buffer):
    accelerator.print("printed once")
assert buffer.getvalue() == "printed once\n"
accelerator.wait_for_everyone()
accelerator.end_training()
print(f"CONTRACT OK {engine_name}")
