"""The fsdp engine on parameters fully_shard cannot shard, at world W, against plain one-process PyTorch loops
written here (no toolkit code in the references). Rank 0 writes what it measured to --out (JSON);
tests/test_fsdp_scalars.py asserts on it.

Two models: Accelerate's RegressionModel (two scalar parameters, nothing to shard) and `TiedNet` (a conv
sharded, a learned temperature and an embedding tied to the output head kept whole). Per optimizer step:
2 micro-steps x W ranks x 4 samples, clipped; the reference takes the same 8W samples in one batch. Then, on
TiedNet: full state dicts saved and restored into a fresh model; no_sync and trigger_sync_in_backward decided
as DDP decides them; a bf16 forward. Last, Accelerate's own test_sync functions against the engine.

    torchrun --nproc_per_node 2 tests/scripts/fsdp_scalar_check.py --out /tmp/check.json
"""
import argparse
import copy
import json
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.test_utils import RegressionModel
from accelerate.test_utils.scripts.test_sync import (test_distributed_sync, test_distributed_sync_multiple_fwd,
                                                     test_noop_sync)
from torch import nn

import toolkit

ACCUM, PER_RANK, STEPS = 2, 4, 3
MAX_NORM = {"regression": 2.0, "tied": 0.5}  # below the first steps' gradient norms: the clip cuts


class TiedNet(nn.Module):
    """Tokens -> embedding -> conv -> output head sharing the embedding's weight, divided by a temperature."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, tokens):
        hidden = torch.tanh(self.conv(self.embed(tokens).transpose(1, 2))).transpose(1, 2)
        return self.head(hidden) / self.temperature


def build(kind, seed):
    torch.manual_seed(seed)
    return TiedNet() if kind == "tied" else RegressionModel(a=0.5 + seed, b=0.25 - seed)


def loss_of(kind, model, x, y):
    out = model(x)
    return F.cross_entropy(out.flatten(0, 1), y.flatten()) if kind == "tied" else F.mse_loss(out, y)


def data(kind):
    g = torch.Generator().manual_seed(3)
    n = STEPS * ACCUM * W * PER_RANK + W * PER_RANK  # one more batch for the step after a restore
    if kind == "tied":
        return torch.randint(0, 10, (n, 5), generator=g), torch.randint(0, 10, (n, 5), generator=g)
    x = torch.randn(n, generator=g)
    return x, 2 * x + 3 + 0.1 * torch.randn(n, generator=g)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)


def max_diff(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def momentum_diff(a, b):  # two optimizer state dicts in torch's layout
    return max((a["state"][i]["momentum_buffer"] - s["momentum_buffer"]).abs().max().item()
               for i, s in b["state"].items())


def spread(tensor):
    """Largest difference between ranks' copies of `tensor` (0 when every rank holds the same)."""
    copies = accelerator.gather(tensor.detach().float().reshape(1, -1))
    return (copies - copies[0]).abs().max().item()


def replicated(model):
    return [p for p in model.parameters() if not hasattr(p, "to_local")]


def sharded(model):
    return [p for p in model.parameters() if hasattr(p, "to_local")]


def reference_step(kind, reference, optimizer, x, y):
    loss_of(kind, reference, x, y).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM[kind]).item()
    optimizer.step()
    optimizer.zero_grad()
    return norm


def engine_step(kind, model, optimizer, x, y, seen):
    """One optimizer step in ACCUM micro-steps, this rank's slice of each; notes where gradients live."""
    for micro in range(ACCUM):
        part = slice(micro * W * PER_RANK, (micro + 1) * W * PER_RANK)
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(kind, model, x[part][rank::W], y[part][rank::W]))
            if not accelerator.sync_gradients:  # still this rank's own: nothing was reduced
                seen["spread_before_sync"].append(min(spread(p.grad) for p in replicated(model)))
                seen["sharded_grad_none_before_sync"].append(all(p.grad is None for p in sharded(model)))
            else:
                seen["spread_at_sync"].append(max(spread(p.grad) for p in replicated(model)))
                seen["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM[kind])))
            optimizer.step()
            optimizer.zero_grad()


def train(kind):
    """STEPS steps of the engine and of the reference from the same weights and data; what they measured."""
    reference, model = build(kind, 0), build(kind, rank)  # prepare must hand every rank rank 0's weights
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    ref_optimizer = sgd(reference.parameters())
    X, Y = data(kind)
    batch = ACCUM * W * PER_RANK
    seen = {"weight_diffs": [], "norms": [], "ref_norms": [], "spread_before_sync": [], "spread_at_sync": [],
            "sharded_grad_none_before_sync": [],
            "kinds": {name: type(p).__name__ for name, p in model.named_parameters()}}
    for step in range(STEPS):
        x, y = X[step * batch:(step + 1) * batch], Y[step * batch:(step + 1) * batch]
        seen["ref_norms"].append(reference_step(kind, reference, ref_optimizer, x, y))
        engine_step(kind, model, optimizer, x, y, seen)
        state = accelerator.get_state_dict(model)
        if rank == 0:
            seen["weight_diffs"].append(max_diff(state, reference.state_dict()))
    opt_state, ref_state = optimizer.state_dict(), ref_optimizer.state_dict()
    if rank == 0:
        seen["opt_groups_equal"] = opt_state["param_groups"] == ref_state["param_groups"]
        seen["opt_state_diff"] = momentum_diff(opt_state, ref_state)
    return seen, (model, optimizer, reference, ref_optimizer, X[STEPS * batch:], Y[STEPS * batch:])


def restore(trained):
    """Full state dicts of the trained model saved, loaded into a fresh sharded model, and one more step taken
    by both and by the reference."""
    model, optimizer, reference, ref_optimizer, x, y = trained
    # Full, on rank 0 only; copied as a file would copy them (a replicated parameter's entries are the live tensors,
    # as in model.state_dict() and optimizer.state_dict()), then handed to every rank as if read back.
    saved = copy.deepcopy([accelerator.get_state_dict(model), optimizer.state_dict()])
    dist.broadcast_object_list(saved, src=0)
    fresh = build("tied", 7)
    fresh, fresh_optimizer = accelerator.prepare(fresh, sgd(fresh.parameters()))
    accelerator.load_full_state_dict(fresh, saved[0])
    fresh_optimizer.load_state_dict(saved[1])
    out = {"still_tied": fresh.head.weight is fresh.embed.weight}
    loaded, loaded_opt = accelerator.get_state_dict(fresh), fresh_optimizer.state_dict()
    if rank == 0:
        out["loaded_diff"] = max_diff(loaded, saved[0])
        out["loaded_opt_diff"] = momentum_diff(loaded_opt, saved[1])
    ref_norm = reference_step("tied", reference, ref_optimizer, torch.cat([x] * ACCUM), torch.cat([y] * ACCUM))
    seen = {"norms": [], "spread_before_sync": [], "spread_at_sync": [], "sharded_grad_none_before_sync": []}
    for net, opt in [(model, optimizer), (fresh, fresh_optimizer)]:
        engine_step("tied", net, opt, torch.cat([x] * ACCUM), torch.cat([y] * ACCUM), seen)
    states = [accelerator.get_state_dict(net) for net in (model, fresh)]
    if rank == 0:
        out["uninterrupted_vs_reference"] = max_diff(states[0], reference.state_dict())
        out["resumed_vs_uninterrupted"] = max_diff(states[1], states[0])
        out["resumed_vs_reference"] = max_diff(states[1], reference.state_dict())
        out["norm_diff"] = abs(seen["norms"][1] - ref_norm)
    return out, fresh, reference


def sync_rules(model, reference, x, y):
    """DDP's rule: a forward under no_sync leaves its backward's gradients on the rank, unless the backward runs
    under trigger_sync_in_backward; then sharded and whole gradients alike hold the sum of both backwards,
    averaged over ranks."""
    model.zero_grad(set_to_none=True)
    with accelerator.no_sync(model):
        first = loss_of("tied", model, x[rank::W], y[rank::W])
    first.backward()  # outside no_sync, but its forward ran inside
    out = {"sharded_none_after_no_sync_forward": all(p.grad is None for p in sharded(model)),
           "spread_after_no_sync_forward": min(spread(p.grad) for p in replicated(model))}
    with accelerator.no_sync(model):
        second = loss_of("tied", model, x[rank::W], y[rank::W])
    with accelerator.trigger_sync_in_backward(model):
        second.backward()
    reference.zero_grad()
    (2 * loss_of("tied", reference, x, y)).backward()
    full = {n: p.grad.full_tensor() if hasattr(p, "to_local") else p.grad for n, p in model.named_parameters()}
    out["grad_diff_after_trigger"] = max((full[n] - p.grad).abs().max().item()
                                         for n, p in reference.named_parameters())
    out["spread_after_trigger"] = max(spread(p.grad) for p in replicated(model))
    return out


def bf16_forward(reference, x):
    """A bf16 forward of models with whole parameters: float32 out, within bf16 rounding of the fp32 model."""
    bf16 = toolkit.build_accelerator("fsdp", mixed_precision="bf16")
    net = build("tied", 0)
    net.load_state_dict(reference.state_dict())
    net, regression = bf16.prepare(net, RegressionModel(a=2, b=3))
    out, expected = net(x), reference(x)
    out.logsumexp(-1).mean().backward()
    line = regression(torch.ones(3))
    return {"dtype": str(out.dtype), "rel_diff": ((out - expected).abs().max() / expected.abs().max()).item(),
            "grad_dtypes": sorted({str(p.grad.dtype) for p in net.parameters()}),
            "regression": [str(line.dtype), line.tolist()]}


def accelerate_sync_tests():
    tests = [test_noop_sync] if W == 1 else [test_distributed_sync, test_distributed_sync_multiple_fwd]
    results = {}
    for test in tests:
        try:
            test(accelerator)
            results[test.__name__] = "passed"
        except Exception:
            results[test.__name__] = traceback.format_exc(limit=-2)
    return results


def main():
    global accelerator, W, rank  # the functions above read them
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    accelerator = toolkit.build_accelerator("fsdp", gradient_accumulation_steps=ACCUM)
    W, rank = accelerator.num_processes, accelerator.process_index
    out = {"world": W}
    out["regression"], _ = train("regression")
    out["tied"], trained = train("tied")
    out["restore"], fresh, reference = restore(trained)
    x, y = trained[4][:W * PER_RANK], trained[5][:W * PER_RANK]
    out["sync_rules"] = sync_rules(fresh, reference, x, y)
    out["bf16"] = bf16_forward(reference, x)
    out["accelerate_sync"] = accelerate_sync_tests()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    accelerator.end_training()
    # The sharded models and the engine holding them go now, while the interpreter is whole, as a recipe's do when
    # its main() returns. Held by module globals, their process group would be freed during interpreter
    # finalization, which torch's gloo teardown does not survive every time (SIGABRT after the results are
    # written; pytorch/pytorch#179291).
    accelerator = None


if __name__ == "__main__":
    main()
