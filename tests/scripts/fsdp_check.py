"""The fsdp engine at world W against a plain one-process PyTorch loop written here (no toolkit code in the
reference). Rank 0 writes what it measured to --out (JSON); tests/test_fsdp.py asserts on it.

Per optimizer step: 2 micro-steps x W ranks x 4 samples; the reference takes the same 8W samples in one
batch, clips at the same norm and steps the same SGD. Then: optimizer/model state dicts (full, torch's
layout), loading them into a fresh sharded model, exact evaluation over uneven shards, gather_for_metrics.
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import toolkit
from toolkit.data.memory import normalize
from toolkit.models.nets import tiny
from toolkit.train.evaluation import EvalMetrics

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

ACCUM, PER_RANK, STEPS, MAX_NORM = 2, 4, 3, 0.3


def net():
    # Output sizes 7 and 3 do not divide by 2 or 4: FSDP pads those shards.
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


accelerator = toolkit.build_accelerator("fsdp", gradient_accumulation_steps=ACCUM)
W, rank = accelerator.num_processes, accelerator.process_index
torch.manual_seed(0)
reference = net()
torch.manual_seed(rank)  # every rank but 0 starts elsewhere: prepare must hand all of them rank 0's weights
model = net()
full_numel = sum(p.numel() for p in model.parameters())
model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
ref_optimizer = sgd(reference.parameters())
local_numel = sum(p.to_local().numel() for p in model.parameters())
g = torch.Generator().manual_seed(1)
global_batch = ACCUM * W * PER_RANK
X, Y = torch.randn(STEPS * global_batch, 6, generator=g), torch.randint(0, 3, (STEPS * global_batch,), generator=g)

out = {"world": W, "full_numel": full_numel, "local_numel": local_numel, "weight_diffs": [], "norms": [],
       "ref_norms": [], "grad_none_before_sync": [], "dtensor_grads_at_sync": []}
mesh = accelerator.torch_device_mesh  # set by a ParallelismConfig (a profile's, under tests/test_parallelism.py)
out["mesh"] = None if mesh is None else [list(mesh.mesh.shape), list(mesh.mesh_dim_names)]
for step in range(STEPS):
    xs, ys = X[step * global_batch:(step + 1) * global_batch], Y[step * global_batch:(step + 1) * global_batch]
    F.cross_entropy(reference(xs), ys).backward()
    out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM).item())
    ref_optimizer.step()
    ref_optimizer.zero_grad()
    for micro in range(ACCUM):
        mx = xs[micro * W * PER_RANK:(micro + 1) * W * PER_RANK][rank::W]
        my = ys[micro * W * PER_RANK:(micro + 1) * W * PER_RANK][rank::W]
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(mx), my))
            if not accelerator.sync_gradients:  # no reduce-scatter ran: no sharded gradient exists yet
                out["grad_none_before_sync"].append(all(p.grad is None for p in model.parameters()))
            else:
                out["dtensor_grads_at_sync"].append(all(type(p.grad).__name__ == "DTensor" for p in model.parameters()))
                out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
    state = accelerator.get_state_dict(model)  # every rank calls it; rank 0 receives the full weights
    if accelerator.is_main_process:
        out["weight_diffs"].append(max_diff(state, reference.state_dict()))

# The optimizer's full state in torch's layout (indices, not names), as a ddp or single run saves it.
opt_state, ref_state = optimizer.state_dict(), ref_optimizer.state_dict()
if accelerator.is_main_process:
    out["opt_groups_equal"] = opt_state["param_groups"] == ref_state["param_groups"]
    out["opt_state_diff"] = max((opt_state["state"][i]["momentum_buffer"] - s["momentum_buffer"]).abs().max().item()
                                for i, s in ref_state["state"].items())

# Loading full state dicts into a fresh sharded model: the next step continues the reference exactly.
torch.manual_seed(5)
fresh = net()
fresh, fresh_optimizer = accelerator.prepare(fresh, sgd(fresh.parameters()))
toolkit.checkpoint.weights.load_model(fresh, reference.state_dict())
fresh_optimizer.load_state_dict(ref_state)
xs, ys = X[:global_batch], Y[:global_batch]
F.cross_entropy(reference(xs), ys).backward()
ref_optimizer.step()
accelerator.gradient_accumulation_steps = 1
with accelerator.accumulate(fresh):
    accelerator.backward(F.cross_entropy(fresh(xs[rank::W]), ys[rank::W]))
    fresh_optimizer.step()
state = accelerator.get_state_dict(fresh)
if accelerator.is_main_process:
    out["resumed_diff"] = max_diff(state, reference.state_dict())

# DDP's habit (Accelerate's gradient_accumulation_for_autoregressive_models.py): model.no_sync() around every
# micro-batch's backward but the last, whose backward reduce-scatters the accumulated sum once; one optimizer
# step equal to the one-process step on the whole global batch.
torch.manual_seed(0)
habit, one_process = net(), net()
one_process.load_state_dict(habit.state_dict())
habit, habit_optimizer = accelerator.prepare(habit, torch.optim.SGD(habit.parameters(), lr=0.1))
one_optimizer = torch.optim.SGD(one_process.parameters(), lr=0.1)
xs, ys = X[:global_batch], Y[:global_batch]
F.cross_entropy(one_process(xs), ys).backward()
one_optimizer.step()
out["no_sync_grad_none"] = []
for micro in range(ACCUM):
    mx = xs[micro * W * PER_RANK:(micro + 1) * W * PER_RANK][rank::W]
    my = ys[micro * W * PER_RANK:(micro + 1) * W * PER_RANK][rank::W]
    if micro < ACCUM - 1:
        with habit.no_sync():
            (F.cross_entropy(habit(mx), my) / ACCUM).backward()
        out["no_sync_grad_none"].append(all(p.grad is None for p in habit.parameters()))  # nothing reduced
    else:
        (F.cross_entropy(habit(mx), my) / ACCUM).backward()
habit_optimizer.step()
state = accelerator.get_state_dict(habit)
if accelerator.is_main_process:
    out["no_sync_diff"] = max_diff(state, one_process.state_dict())

# Exact evaluation: 101 images over W ranks in batches of 25, a number no world size > 1 divides.
torch.manual_seed(0)
image_net, ref_image_net = tiny(10), tiny(10)
ref_image_net.load_state_dict(image_net.state_dict())
image_net = accelerator.prepare(image_net)
images = torch.randint(0, 256, (101, 3, 32, 32), dtype=torch.uint8, generator=g)
labels = torch.randint(0, 10, (101,), generator=g)
# A prepared loader pads the last batches so every rank runs as many (FSDP's collectives pair up);
# gather_for_metrics drops the padding again.
test_loader = accelerator.prepare(DataLoader(TensorDataset(normalize(images), labels), batch_size=25))
evaluation = EvalMetrics()
with torch.no_grad():
    for batch, targets in test_loader:
        evaluation.update(*accelerator.gather_for_metrics((image_net(batch), targets)))
metrics = evaluation.compute()
with torch.no_grad():
    logits = ref_image_net(normalize(images))
out["eval"] = metrics
out["ref_eval"] = {"accuracy": (logits.argmax(1) == labels).float().mean().item(),
                   "loss": F.cross_entropy(logits, labels).item(), "count": 101}

loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
out["gathered"] = torch.cat([accelerator.gather_for_metrics(x) for (x,) in loader]).tolist()
# A sharded save whose folder rank 0 cannot make (its root is a file): rank 0 raises the cause at once and the
# other ranks stop quietly, instead of waiting --timeout seconds for shards.
from pathlib import Path  # noqa: E402

import torch.distributed as dist  # noqa: E402

from toolkit.checkpoint.functional_sharded import save_sharded_checkpoint  # noqa: E402

blocked = Path(args.out).with_name("a-file-not-a-folder")
if accelerator.is_main_process:
    blocked.write_text("")
accelerator.wait_for_everyone()
try:
    save_sharded_checkpoint(blocked, 1, model=fresh, optimizer=fresh_optimizer)
    outcome = "saved"
except Exception as error:
    outcome = type(error).__name__
out["blocked_save"] = [None] * accelerator.num_processes
dist.all_gather_object(out["blocked_save"], outcome)

if accelerator.is_main_process:
    with open(args.out, "w") as f:
        json.dump(out, f)
accelerator.end_training()
