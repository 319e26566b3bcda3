"""The fsdp engine under Accelerate's FSDP settings, at world 2: each setting's effect, seen in the prepared model,
and the same training as a plain one-process PyTorch loop written here (no toolkit code in the reference).
Launched by `toolkit launch` with an FSDP profile (tests/test_fsdp_settings.py): the first case takes the profile's
fsdp_config; every other case passes `Accelerator(fsdp_plugin=...)` with the profile's variables cleared. Rank 0
writes one JSON entry per case to --out; a case that raises records its one line.
"""
import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import FullyShardedDataParallelPlugin as Plugin
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

import toolkit
from toolkit.engines.fsdp import fsdp_modules
from toolkit.errors import UserError
from toolkit.models.blocks import Checkpointed

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

PER_RANK, STEPS, WIDTH = 3, 2, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


g = torch.Generator().manual_seed(5)
X, Y = torch.randn(STEPS, 2 * PER_RANK, 6, generator=g), torch.randint(0, 3, (STEPS, 2 * PER_RANK), generator=g)
torch.manual_seed(3)
reference = Net()
initial = {k: v.clone() for k, v in reference.state_dict().items()}
ref_optimizer = sgd(reference.parameters())
for step in range(STEPS):  # the whole global batch in one process
    ref_optimizer.zero_grad()
    F.cross_entropy(reference(X[step]), Y[step]).backward()
    ref_optimizer.step()
trained = reference.state_dict()


def run_case(plugin=None, meta_on_rank_1=False, **kwargs):
    accelerator = toolkit.build_accelerator("fsdp", fsdp_plugin=plugin, **kwargs)
    rank = accelerator.process_index
    if meta_on_rank_1 and rank == 1:  # as cpu_ram_efficient_loading's users do: only rank 0 holds weights
        with torch.device("meta"):
            model = Net()
    else:
        torch.manual_seed(3 + rank)  # rank 1 starts elsewhere: prepare hands it rank 0's weights
        model = Net()
        if rank == 0:
            model.load_state_dict(initial)
    graphs_before = counters["stats"]["unique_graphs"]
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    seen = {"dtypes": set(), "lin1_calls": 0}

    def record(module, inputs, output):
        seen["dtypes"].add(str(inputs[0].dtype).replace("torch.", ""))
        seen["lin1_calls"] += 1

    model.blocks[0].lin1.register_forward_hook(record)
    after_forward = []
    for step in range(STEPS):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss = F.cross_entropy(model(X[step][mine]), Y[step][mine])
        # Between forward and backward: a unit that reshards holds its shards (DTensors) again.
        after_forward.append(isinstance(model.blocks[0].lin1.weight, DTensor))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = accelerator.get_state_dict(model)
    fsdp_param = model.blocks[0].lin1.weight
    result = {
        "units": len(fsdp_modules(model)),
        "checkpointed": sum(isinstance(m, Checkpointed) for m in model.modules()),
        "sharded_after_forward": after_forward,
        "compute_dtypes": sorted(seen["dtypes"]),
        "param_dtype": str(fsdp_param.dtype).replace("torch.", ""),
        "lin1_calls_per_step": seen["lin1_calls"] / STEPS,
        "offloaded": bool(model.blocks[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu)
        if hasattr(model.blocks[0], "_get_fsdp_state") else None,
        "state_keys_per_rank": accelerator.gather_object([len(state)]),
        "max_diff": max((state[k].float() - trained[k].float()).abs().max().item() for k in trained)
        if state else None,
        "checkpoint_format": accelerator.checkpoint_format,
        "head_sharded": isinstance(model.head.weight, DTensor),
        "compiled_graphs": counters["stats"]["unique_graphs"] - graphs_before,
        "prepared": type(model).__name__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(accelerator.gather_object([tmp])[0]) / "ckpt"
        accelerator.save_state(str(folder))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            result["saved"] = sorted(p.name for p in folder.iterdir())
        accelerator.wait_for_everyone()
    return result


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


def bf16_batchnorm(plugin=None):
    """bf16 with BatchNorm, in blocks and outside them (the layers the root holds under a wrap policy)."""
    accelerator = toolkit.build_accelerator("fsdp", fsdp_plugin=plugin, mixed_precision="bf16")
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), ConvBlock(), nn.MaxPool2d(2),
                          ConvBlock(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    model._no_split_modules = ["ConvBlock"]
    seen = set()
    for conv in [m for m in model.modules() if isinstance(m, nn.Conv2d)]:
        conv.register_forward_pre_hook(lambda module, args: seen.add(str(args[0].dtype).replace("torch.", "")))
    model, optimizer = accelerator.prepare(model, sgd(model.parameters()))
    images = torch.randn(STEPS, 2, 3, 8, 8, generator=torch.Generator().manual_seed(accelerator.process_index))
    losses = []
    for step in range(STEPS):
        loss = F.cross_entropy(model(images[step]), torch.tensor([0, 2]))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "conv_inputs": sorted(seen), "bn_weight": str(model[1].weight.dtype).replace("torch.", ""),
            "output": str(model(images[0]).dtype).replace("torch.", "")}


def refusal(**plugin):
    try:
        toolkit.build_accelerator("fsdp", fsdp_plugin=Plugin(**plugin)).prepare(Net())
    except UserError as error:
        return str(error)
    return None


def clear_fsdp_variables():
    """The plugins below say everything themselves, as a script outside a profile would. (Accelerate's plugin
    also sets FSDP_CPU_RAM_EFFICIENT_LOADING itself when given cpu_ram_efficient_loading.)"""
    for name in [k for k in os.environ if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"]:
        del os.environ[name]


results = {"profile": run_case()}
clear_fsdp_variables()
V2 = {"fsdp_version": 2}
BLOCKS = {**V2, "auto_wrap_policy": "transformer_based_wrap"}
results.update({
    "default": run_case(),
    "no_wrap": run_case(Plugin(**V2)),
    "transformer": run_case(Plugin(**BLOCKS)),
    "named": run_case(Plugin(**BLOCKS, transformer_cls_names_to_wrap=["Linear"])),
    "size": run_case(Plugin(**V2, auto_wrap_policy="size_based_wrap", min_num_params=300)),
    "reshard_false": run_case(Plugin(**BLOCKS, reshard_after_forward=False)),
    "fsdp1_shard_grad_op": run_case(Plugin(sharding_strategy="SHARD_GRAD_OP", auto_wrap_policy="transformer_based_wrap")),
    "example": run_case(Plugin(state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=False))),
    "activation_checkpointing": run_case(Plugin(**BLOCKS, activation_checkpointing=True)),
    "mixed_precision": run_case(Plugin(**BLOCKS, mixed_precision_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))),
    "cpu_offload": run_case(Plugin(**BLOCKS, cpu_offload=True)),
    "sharded": run_case(Plugin(**BLOCKS, state_dict_type="SHARDED_STATE_DICT")),
    "ignored_modules": run_case(Plugin(**BLOCKS, ignored_modules="head")),
    "compiled": run_case(Plugin(**BLOCKS), dynamo_backend="inductor"),
    "cpu_ram_efficient_loading": run_case(Plugin(**BLOCKS, cpu_ram_efficient_loading=True), meta_on_rank_1=True),
})
bf16 = {"default": bf16_batchnorm(), "wrapped": bf16_batchnorm(Plugin(**BLOCKS))}
clear_fsdp_variables()
refusals = {
    "backward_prefetch": refusal(backward_prefetch="BACKWARD_PRE"),
    "no_shard": refusal(sharding_strategy="NO_SHARD"),
    "unknown_class": refusal(**BLOCKS, transformer_cls_names_to_wrap=["Nope"]),
    "ac_without_wrap": refusal(**V2, activation_checkpointing=True),
}
try:
    toolkit.build_accelerator("fsdp", fsdp_plugin=Plugin(**V2), checkpoint_format="full")  # FSDP2's default: sharded
except UserError as error:
    refusals["contradicting_format"] = str(error)
if int(os.environ["RANK"]) == 0:
    Path(args.out).write_text(json.dumps({"cases": results, "refusals": refusals, "bf16": bf16}, indent=1))
