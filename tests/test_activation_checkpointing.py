"""--activation-checkpointing and --compile, block by block (toolkit/models/blocks.py, via `adapt_model`):
training with checkpointed blocks equals training without them on every engine (loss, gradients, BatchNorm's
running statistics), the state dict keeps its keys, checkpointing saves less for backward, and under fsdp the
model is sharded into as many units with --compile as without.
"""

import copy
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import PY, ROOT, run

from toolkit.models.blocks import Checkpointed, checkpoint_blocks, compile_blocks
from toolkit.models.gpt import build_gpt
from toolkit.models.nets import build_model
from toolkit.train import adapt_model

# Recomputation repeats the forward's arithmetic exactly on CPU (measured: every difference is 0.0); a second
# BatchNorm update would move the running mean by ~1e-3.
TIGHT = 1e-6

TRAIN = """
import json, sys, types
import torch, torch.nn.functional as F
from toolkit.models.blocks import Checkpointed
from toolkit.models.gpt import build_gpt
from toolkit.models.nets import build_model
from toolkit.train import adapt_model


def flags(ac=False, compile=False):
    return types.SimpleNamespace(sync_bn=False, channels_last=False, activation_checkpointing=ac, compile=compile)


def whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor: the full gradient (a collective)


def train(accelerator, ac, model_name="resnet18"):
    # 2 SGD steps, each rank its own batch; the loss averaged over ranks, gradients of the second step.
    torch.manual_seed(0)
    net = build_gpt("gpt-tiny", 60) if model_name == "gpt" else build_model(model_name, 10)
    model, _ = adapt_model(net, flags(ac), accelerator)
    checkpointed = sum(isinstance(m, Checkpointed) for m in model.modules())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    losses = []
    for _ in range(2):
        if model_name == "gpt":
            x = torch.randint(0, 60, (4, 16), generator=g)
            y = torch.randint(0, 60, (4, 16), generator=g)
            loss = F.cross_entropy(model(x.to(accelerator.device)).flatten(0, 1), y.flatten().to(accelerator.device))
        else:
            x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
            loss = F.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
        accelerator.backward(loss)
        grads = {name: whole(p.grad).cpu() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    state = {k: v.cpu() for k, v in accelerator.get_state_dict(model).items()}
    return dict(losses=losses, grads=grads, state=state, checkpointed=checkpointed)


def compare(accelerator, model_name="resnet18"):
    plain, ac = train(accelerator, False, model_name), train(accelerator, True, model_name)
    if not accelerator.is_main_process:
        return None
    bn = [k for k in plain["state"] if k.endswith("running_mean")]
    return dict(
        checkpointed=ac["checkpointed"], plain_checkpointed=plain["checkpointed"],
        keys_equal=list(plain["state"]) == list(ac["state"]),
        loss=max(abs(a - b) for a, b in zip(plain["losses"], ac["losses"])),
        grad=max((plain["grads"][k] - ac["grads"][k]).abs().max().item() for k in plain["grads"]),
        state=max((plain["state"][k].double() - ac["state"][k].double()).abs().max().item() for k in plain["state"]),
        batches_tracked=sorted({int(v) for k, v in ac["state"].items() if k.endswith("num_batches_tracked")}),
        bn_moved=min(plain["state"][k].abs().max().item() for k in bn) if bn else None,
    )
"""

ONE_PROCESS = TRAIN + """
import toolkit

out = {}
for engine in ("single", "dp", "accelerate"):
    out[engine] = compare(toolkit.build_accelerator(engine))
out["single gpt"] = compare(toolkit.build_accelerator("single"), "gpt")
print(json.dumps(out))
"""

TWO_RANKS = TRAIN + """
import os
import toolkit
from toolkit.engines.fsdp import fsdp_modules


def worker(out_path):
    from toolkit.engines.ddp import RawDDPEngine
    from toolkit.engines.fsdp import FSDPEngine
    from toolkit.launch.env import read_launch_env

    env = read_launch_env()
    ddp = RawDDPEngine(env)  # forms the group; the fsdp engine joins it
    fsdp = FSDPEngine(env)
    out = {"world": fsdp.num_processes, "ddp": compare(ddp), "fsdp": compare(fsdp), "fsdp gpt": compare(fsdp, "gpt"),
           "units": {}}
    for name, build in (("resnet18", lambda: build_model("resnet18", 10)), ("gpt", lambda: build_gpt("gpt-tiny", 60))):
        for label, kwargs in (("plain", {}), ("compile", dict(compile=True)), ("ac", dict(ac=True)),
                              ("ac+compile", dict(ac=True, compile=True))):
            model, _ = adapt_model(build(), flags(**kwargs), fsdp)
            model = fsdp.prepare(model)
            out["units"][f"{name} {label}"] = len(fsdp_modules(model))
    # What --compile did before: the whole model compiled, then sharded.
    whole = fsdp.prepare(torch.compile(build_model("resnet18", 10)))
    out["units"]["resnet18 whole-model compile"] = len(fsdp_modules(whole))
    if fsdp.is_main_process:
        with open(out_path, "w") as f:
            json.dump(out, f)
    ddp.end_training()


if __name__ == "__main__":
    toolkit.spawn(worker, 2, sys.argv[1])
"""


@pytest.fixture(scope="module")
def one_process():
    """single, dp and accelerate (one process each, one after another): resnet18 and the GPT, plain vs checkpointed."""
    return json.loads(run([PY, "-c", ONE_PROCESS], timeout=240).stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """ddp and fsdp on one 2-rank gloo world, plus the FSDP unit counts with and without the flags."""
    folder = tmp_path_factory.mktemp("ac")
    script, out = folder / "two_ranks.py", folder / "out.json"
    script.write_text(TWO_RANKS)
    run([PY, script, out], timeout=300, PYTHONPATH=ROOT)
    return json.loads(out.read_text())


def flags(ac=False, compile=False):
    return types.SimpleNamespace(sync_bn=False, channels_last=False, activation_checkpointing=ac, compile=compile)


def equal_training(seen, blocks=8):
    assert seen["plain_checkpointed"] == 0 and seen["checkpointed"] == blocks
    assert seen["keys_equal"]
    assert max(seen["loss"], seen["grad"], seen["state"]) <= TIGHT, seen


@pytest.mark.parametrize("engine", ["single", "dp", "accelerate"])
def test_one_process_engines_train_the_same_with_checkpointed_blocks(one_process, engine):
    seen = one_process[engine]
    equal_training(seen)
    assert seen["batches_tracked"] == [2]  # one BatchNorm update per forward, not two
    assert seen["bn_moved"] > 1e-3  # the statistics did move: equal is not trivially equal


def test_the_gpts_blocks_are_checkpointed_and_train_the_same(one_process, two_ranks):
    """Its tied embedding and head stay whole under fsdp; the blocks between them are sharded and checkpointed."""
    equal_training(one_process["single gpt"], blocks=2)
    equal_training(two_ranks["fsdp gpt"], blocks=2)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_rank_engines_train_the_same_with_checkpointed_blocks(two_ranks, engine):
    assert two_ranks["world"] == 2
    seen = two_ranks[engine]
    equal_training(seen)
    assert seen["batches_tracked"] == [2] and seen["bn_moved"] > 1e-3


def test_fsdp_shards_as_many_units_with_compile_and_checkpointing_as_without(two_ranks):
    """Issue 22's "Done when": resnet18's 11 blocks plus the root, whichever flags are on. Compiling the whole
    model first (what --compile did) left fully_shard one block."""
    units = two_ranks["units"]
    assert units["resnet18 plain"] == 12 and units["gpt plain"] == 7  # embeddings, 2 blocks, ln_f, head, root
    for model in ("resnet18", "gpt"):
        counts = [units[f"{model} {flags}"] for flags in ("plain", "compile", "ac", "ac+compile")]
        assert counts == [counts[0]] * 4, (model, counts)
    assert units["resnet18 whole-model compile"] == 2


def test_compile_goes_block_by_block_and_keeps_the_state_dict():
    """Module.compile in place: each unit keeps its type and names (nothing is traced until a forward runs)."""
    model = build_model("resnet18", 10)
    keys = list(model.state_dict())
    said = []
    single = types.SimpleNamespace(name="single", print=said.append)
    compiled, _ = adapt_model(model, flags(ac=True, compile=True), single)
    assert compiled is model and list(compiled.state_dict()) == keys
    assert said == ["[toolkit] --activation-checkpointing: 8 blocks recompute their activations in backward"]
    adapt_model(build_model("tiny", 10), flags(ac=True), single)
    assert said[-1].endswith("the model has no blocks with layers inside (only lone layers, which keep their inputs "
                             "anyway); nothing is recomputed")
    assert all(hasattr(block, "_compiled_call_impl") for block in model.layers)
    assert type(model.layers[0]).__name__ == "BasicBlock"  # the name Accelerate's FSDP profile wraps by
    whole, _ = adapt_model(build_model("resnet18", 10), flags(compile=True), types.SimpleNamespace(name="dp"))
    assert type(whole).__name__ == "OptimizedModule"  # dp: a replica of a compiled block would run the original


def test_checkpoints_move_between_runs_with_and_without_the_flag():
    torch.manual_seed(0)
    plain = build_model("resnet18", 10)
    checkpointed = build_model("resnet18", 10)
    checkpoint_blocks(checkpointed)
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    checkpointed.load_state_dict(plain.state_dict())
    plain.load_state_dict(checkpointed.state_dict())
    clone = copy.deepcopy(checkpointed)  # an EMA copy, say, stays checkpointed and equal
    assert isinstance(clone.layers[0], Checkpointed)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(plain.eval()(x), checkpointed.eval()(x))


def test_running_statistics_move_once_per_step():
    """The rerun in backward would update BatchNorm's running mean a second time; it updates a throwaway copy."""
    torch.manual_seed(0)
    plain = build_model("resnet18", 10)
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(checkpointed)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    for model in (plain, checkpointed):
        F.cross_entropy(model(x), y).backward()
    bn = plain.layers[0].bn1, checkpointed.layers[0].bn1
    assert torch.equal(bn[0].running_mean, bn[1].running_mean) and torch.equal(bn[0].running_var, bn[1].running_var)
    assert int(bn[1].num_batches_tracked) == 1
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), checkpointed.parameters()))


def test_checkpointing_saves_a_third_of_the_activations():
    """resnet18 at 32x32, batch 8: 35.9 MiB saved for backward plain, 11.4 MiB checkpointed (0.317 x: each
    block keeps only its input), counted as benchmarks/memory.py counts them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory import saved_bytes

    torch.manual_seed(0)
    plain = build_model("resnet18", 10)
    checkpointed = copy.deepcopy(plain)
    checkpoint_blocks(checkpointed)
    x = torch.randn(8, 3, 32, 32)
    ratio = saved_bytes(checkpointed, x) / saved_bytes(plain, x)
    assert 0.25 < ratio < 0.4, ratio


def test_only_blocks_with_layers_inside_are_checkpointed():
    assert checkpoint_blocks(build_model("tiny", 10)) == []  # lone convs and a linear layer: nothing to gain
    assert len(checkpoint_blocks(build_gpt("gpt-tiny", 60))) == 2
    assert [type(b).__name__ for b in checkpoint_blocks(build_model("resnet9", 10))] == [
        "Sequential", "Sequential", "_Residual", "Sequential", "Sequential", "_Residual"]  # not pools, head, scale
    assert compile_blocks(torch.nn.Linear(2, 2)).__class__.__name__ == "OptimizedModule"  # no units: compiled whole
