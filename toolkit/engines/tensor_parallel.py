"""Tensor parallel (Megatron-LM's split, torch.distributed.tensor.parallel) from the plan a model declares.

A model says how it splits as data, in transformers' convention: `model._tp_plan` maps module-name patterns (`*`
for one name part, a block's number) to the styles below, and `model.tp_heads` (or a transformers config's
`num_attention_heads`) is what the attention splits by. The fsdp engine applies the plan over the mesh's `tp`
dimension before it shards the data-parallel ones (FSDP2 + TP, torchtitan's order):

    colwise             a Linear's output features split (its weight's rows); input whole, output the local share
    rowwise             a Linear's input features split; the outputs summed over the tp ranks (all-reduce)
    rowwise_sequence    rowwise, its sum scattered along the sequence (reduce-scatter): sequence parallel's exit
    colwise_rep         colwise, its output gathered whole (transformers' name)
    embedding           an Embedding's rows (the vocabulary) split; each rank looks up its own, the sum all-reduced
    replicate           parameters whole on every tp rank (a position embedding): its gradients agree there
    sequence_split      a module's whole output cut along the sequence, each rank keeping its part (no communication)
    sequence_parallel   a norm run on each rank's part of the sequence (weights whole; gradients summed)
    sequence_gather     a module's input gathered whole from the sequence parts (all-gather) before it runs
    loss_parallel       the output layer colwise from sequence parts, its logits left split over the vocabulary for
                        torch's loss_parallel cross-entropy (the engine hands `model(x)` whole logits)

Tied weights (an embedding and its output head, split alike) stay one parameter.
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from toolkit.config import listing
from toolkit.errors import UserError


class ReplicateParallel(ParallelStyle):
    """Parameters whole (Replicate) on the tp mesh; the module takes and returns plain tensors."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def as_dtensor(module, inputs, mesh):
            return tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False)
                         if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)

        def as_local(module, output, mesh):  # a tensor of its own: FSDP2 warns on a unit that returns a view
            return output.to_local().clone() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, input_fn=as_dtensor, output_fn=as_local)


STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_sequence": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "embedding": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "replicate": ReplicateParallel,
    "sequence_split": lambda: PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    "sequence_parallel": lambda: SequenceParallel(),
    "sequence_gather": lambda: PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "loss_parallel": lambda: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's plan (its own `_tp_plan`, or a transformers model's), or one sentence saying it has none."""
    plan = getattr(model, "_tp_plan", None)
    if not plan:
        raise UserError(f"{type(model).__name__} declares no tensor-parallel plan (`_tp_plan`: module-name patterns "
                        f"mapped to styles, as transformers' models and toolkit/models/gpt.py declare); train it "
                        f"without tp_size, or give it one.")
    unknown = sorted({style for style in plan.values() if style not in STYLES})
    if unknown:
        raise UserError(f"{type(model).__name__}'s tensor-parallel plan names style(s) {listing(unknown, 3)} that "
                        f"the toolkit does not know; use {', '.join(STYLES)}.")
    return dict(plan)


def heads(model: nn.Module) -> int | None:
    """What the attention splits by: the model's `tp_heads`, or a transformers config's attention heads."""
    config = getattr(model, "config", None)
    found = getattr(model, "tp_heads", None) or getattr(config, "num_key_value_heads", None) or getattr(
        config, "num_attention_heads", None)
    return int(found) if found else None


def check_tp_size(model: nn.Module, tp: int) -> None:
    """A tp size the model can take: one that divides its attention heads (a head is never cut in two)."""
    count = heads(model)
    if count is not None and count % tp:
        raise UserError(f"tp_size {tp} cannot split {type(model).__name__}'s {count} attention heads evenly; use a "
                        f"tp_size that divides {count}.")


def _matches(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """The plan by module name: each pattern's `*` stands for one name part; a pattern that matches nothing is an
    error (a renamed layer would otherwise silently stay whole on every rank)."""
    names = [name for name, _ in model.named_modules() if name]
    found = {}
    for pattern, style in plan.items():
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+") + r"\Z")
        hits = [name for name in names if regex.match(name)]
        if not hits and pattern.split(".")[0] in getattr(model, "other_stages_modules", ()):
            continue  # a pipeline stage's: the module is another stage's (engines/pipeline.py)
        if not hits:
            raise UserError(f"{type(model).__name__}'s tensor-parallel plan names {pattern!r}, which matches none "
                            f"of its modules; fix the plan.")
        found.update({name: style for name in hits})
    return found


def parallelize(model: nn.Module, tp_mesh) -> nn.Module:
    """Apply the model's plan over the 1-D `tp_mesh`, in place; weights tied before stay tied."""
    check_tp_size(model, tp_mesh.size())
    # DTensor logs a hint each time it reduces over two mesh dimensions in two collectives (the clipping norm, a
    # full state dict): a cost note, not an error (every rank still ends with the same value), said on every rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    by_name = _matches(tp_plan(model), model)
    tied = tied_names(model)
    # Outer modules first: a module's input/output preparation wraps what its children do.
    for name in sorted(by_name, key=lambda n: n.count(".")):
        parallelize_module(model.get_submodule(name), tp_mesh, STYLES[by_name[name]]())
    for names in tied:  # each style made its own DTensor parameter; the first one stands for all
        owner, _, leaf = names[0].rpartition(".")
        first = getattr(model.get_submodule(owner), leaf)
        for other in names[1:]:
            owner, _, leaf = other.rpartition(".")
            setattr(model.get_submodule(owner), leaf, first)
    return model


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter registered under more than one name."""
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    return [names for names in by_param.values() if len(names) > 1]


def whole(output):
    """A model's output as the user's code sees it: DTensors (logits split over the vocabulary) made whole."""
    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, tuple):
        return tuple(whole(o) for o in output)
    if isinstance(output, list):
        return [whole(o) for o in output]
    if isinstance(output, dict):
        return type(output)({k: whole(v) for k, v in output.items()}) if type(output) is dict else output
    return output
