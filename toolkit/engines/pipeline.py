"""Pipeline parallel (torch.distributed.pipelining) from the split a model declares.

A model says where stages cut, as data: `model._pp_plan = {"embed": [...], "blocks": "blocks", "output": [...]}`:
stages cut between the blocks of the ModuleList named by "blocks"; the first stage also runs `model.embed(x)`
(with the modules listed under "embed"), the last `model.output(x)` (with those under "output"), so that
`model(x) == model.output(<each block>(model.embed(x)))`. The fsdp engine cuts the model in place on each rank
of the mesh's `pp` dimension: a stage keeps its blocks under their own numbers (a ModuleDict {"2": block 2, ...}), so
its state dict names are the whole model's and the stages' names together are the whole model's.

A training step is a schedule of forward and backward over micro-batches (`accelerator.forward_backward`): GPipe
(every micro-batch's forward, then every backward) or 1F1B (one forward, one backward once the pipe is full: at most
`stages` micro-batches' activations held). Each micro-batch's loss is divided by the micro-batch count and the
accumulation, so the gradients are the step's mean, as one process's. A weight tied between the first and the
last stage (an embedding and its output head) is one copy on each: their gradients are summed between the two, as
Megatron-LM does, so both copies take the same step. `model(x)` outside a schedule (evaluation) runs the stages one
after the other and hands every stage the last one's output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from toolkit.engines.tensor_parallel import tied_names
from toolkit.errors import UserError

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def pp_plan(model: nn.Module) -> dict:
    """The model's split, or one sentence saying it has none."""
    plan = getattr(model, "_pp_plan", None)
    if not plan or not isinstance(getattr(model, plan.get("blocks", ""), None), nn.ModuleList):
        raise UserError(f"{type(model).__name__} declares no pipeline split (`_pp_plan` naming its ModuleList of "
                        f"blocks, and the modules its `embed` and `output` use, as toolkit/models/gpt.py does); "
                        f"train it without pp_size, or give it one.")
    return plan


def block_ranges(count: int, stages: int) -> list[range]:
    """The blocks of each stage: as even as they go, the first stages one more."""
    size, extra = divmod(count, stages)
    starts = [s * size + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def stage_blocks(blocks: nn.ModuleList, indices: range) -> nn.ModuleDict:
    """This stage's blocks under their own numbers: its state dict names are the whole model's."""
    return nn.ModuleDict({str(i): blocks[i] for i in indices})


def share_tied(model: nn.Module, state: dict, tied: list[list[str]] | None = None) -> dict:
    """A full state dict whose tied weights are one tensor under each of their names, as a plain model's state dict
    has them (tensor parallel and pipeline stages gather each name's copy apart)."""
    for names in tied_names(model) if tied is None else tied:
        present = [name for name in names if name in state]
        for name in present[1:]:
            state[name] = state[present[0]]
    return state


class Pipeline:
    """One prepared model's stage on this rank, its schedule and its neighbours along the `pp` dimension of `mesh`."""

    def __init__(self, model: nn.Module, mesh, schedule: str, microbatches: int, device: torch.device):
        pp, self.device = mesh["pp"], device
        self.stages, self.index = pp.size(), pp.get_local_rank()
        self.group, self.ranks = pp.get_group(), pp.mesh.tolist()
        self.first, self.last = self.index == 0, self.index == self.stages - 1
        self.schedule_name, self.microbatches = schedule, microbatches
        self.plan = plan = pp_plan(model)
        blocks = getattr(model, plan["blocks"])
        if len(blocks) < self.stages:
            raise UserError(f"pp_size {self.stages} is more stages than {type(model).__name__}'s {len(blocks)} "
                            f"blocks; use a pp_size of at most {len(blocks)}.")
        self.whole_tied = tied_names(model)  # the whole model's tied names, for a gathered state dict
        self.tied = self._tied_pairs(model, mesh)
        whole = set(model.state_dict())
        canonical = {name: names[0] for names in tied_names(model) for name in names}  # named_parameters' first
        setattr(model, plan["blocks"], stage_blocks(blocks, block_ranges(len(blocks), self.stages)[self.index]))
        gone = ([] if self.first else plan["embed"]) + ([] if self.last else plan["output"])
        for name in gone:
            delattr(model, name)
        model.other_stages_modules = frozenset(gone)  # a tensor-parallel plan's patterns for them match nothing here
        # What a checkpoint of the whole model holds for the other stages, and the whole model's name of a tied
        # weight this stage holds under its other name (toolkit/checkpoint reads both).
        model.other_stages_keys = frozenset(whole - set(model.state_dict()))
        model.checkpoint_aliases = {name: canonical[name] for name in dict(model.named_parameters())
                                    if canonical.get(name, name) != name}
        self.scheduling, self._loss_fn, self._schedule, self._raw = False, None, None, []

    def _tied_pairs(self, model, mesh) -> tuple:
        """(this stage's name of a weight tied between the first and last stage, the group of the two ranks that hold
        it) or (); every rank forms every pair's group, in one order."""
        spans = [names for names in tied_names(model) if any(n.split(".")[0] in self.plan["embed"] for n in names)
                 and any(n.split(".")[0] in self.plan["output"] for n in names)]
        if not spans or self.stages == 1:
            return ()
        mine = None
        for column in mesh.mesh.reshape(self.stages, -1).T.tolist():
            group = dist.new_group([column[0], column[-1]])
            if dist.get_rank() in (column[0], column[-1]):
                mine = group
        names = spans[0]
        if self.first:
            return next(n for n in names if n.split(".")[0] in self.plan["embed"]), mine
        return (next(n for n in names if n.split(".")[0] in self.plan["output"]), mine) if self.last else ()

    def stage_forward(self, model, x):
        if self.first:
            x = model.embed(x)
        for block in getattr(model, self.plan["blocks"]).values():
            x = block(x)
        return model.output(x) if self.last else x

    def forward(self, model, x):
        """The stage's part inside a schedule; outside one, the whole pipeline, its output on every stage."""
        if self.scheduling:
            return self.stage_forward(model, x)
        if not self.first:
            x = self._receive(self.ranks[self.index - 1])
        x = self.stage_forward(model, x)
        if not self.last:
            self._send(x, self.ranks[self.index + 1])
        return self._from_last(x)

    def _send(self, tensor, rank):
        meta = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape], device=tensor.device)
        dist.send(torch.tensor([meta.numel()], device=tensor.device), rank)
        dist.send(meta, rank)
        dist.send(tensor.contiguous(), rank)

    def _receive(self, rank):
        device = self.device
        count = torch.zeros(1, dtype=torch.long, device=device)
        dist.recv(count, rank)
        meta = torch.zeros(int(count), dtype=torch.long, device=device)
        dist.recv(meta, rank)
        tensor = torch.empty(meta[2:].tolist(), dtype=_DTYPES[int(meta[0])], device=device)
        dist.recv(tensor, rank)
        return tensor

    def _from_last(self, output):
        """The last stage's output, broadcast to every stage (the ranks of one pipeline hold the same batch)."""
        if self.last:
            for rank in self.ranks[:-1]:
                self._send(output.full_tensor() if isinstance(output, DTensor) else output, rank)
            return output
        return self._receive(self.ranks[-1])

    def step(self, model, inputs, targets, loss_fn, accumulation: int) -> torch.Tensor:
        """One micro-step's schedule: forward and backward of `microbatches` slices of the batch; the mean loss, on
        every stage."""
        if inputs.shape[0] % self.microbatches:
            raise UserError(f"a pipeline splits each batch into {self.microbatches} micro-batches; this batch of "
                            f"{inputs.shape[0]} does not divide evenly; make the micro-batch size a multiple of "
                            f"{self.microbatches}.")
        if self._schedule is None:
            stage = PipelineStage(model, self.index, self.stages, self.device, group=self.group)
            self._schedule = SCHEDULES[self.schedule_name](stage, self.microbatches, loss_fn=self._scaled_loss,
                                                           scale_grads=False)
        self._loss_fn, self._scale, self._raw = loss_fn, self.microbatches * accumulation, []
        self.scheduling = True
        try:
            self._schedule.step(*([inputs] if self.first else []), **({"target": targets} if self.last else {}))
        finally:
            self.scheduling = False
        # The micro-batches' losses are the last ones: a schedule's first step also runs the loss once on the shapes it
        # infers the stages' messages from.
        raw = self._raw[-self.microbatches:]
        loss = torch.stack(raw).mean() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.ranks[-1], group=self.group)
        return loss

    def _scaled_loss(self, output, target):
        loss = self._loss_fn(output, target)
        whole = loss.full_tensor() if isinstance(loss, DTensor) else loss  # under tp: a replicated DTensor
        self._raw.append(whole.detach().float().reshape(()))
        return loss / self._scale  # each micro-batch's share of the step's mean

    def sum_tied(self, model):
        """Sum a tied weight's gradients between its copies on the first and the last stage."""
        if not self.tied:
            return
        name, group = self.tied
        grad = model.get_parameter(name).grad
        if grad is not None:
            dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)

    def whole_state_dict(self, model, main: bool) -> dict:
        """The whole model's state dict on the main process (a collective: every rank calls it; the others get {}):
        each stage's full state dict (gathered over its data-parallel and tp ranks), then all stages' together."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        mine = {k: v.cpu() for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()}
        parts = [None] * dist.get_world_size() if main else None
        dist.gather_object(mine, parts, dst=0)
        if not main:
            return {}
        return share_tied(model, {k: v for part in parts for k, v in part.items()}, self.whole_tied)

    def counted(self, model, parameters: list) -> list:
        """The parameters whose gradients count in the norm: a tied weight's once (the first stage's copy)."""
        if not self.tied or self.first:
            return parameters
        duplicate = model.get_parameter(self.tied[0])
        return [p for p in parameters if p is not duplicate]

    def combine_norm(self, norm: torch.Tensor, norm_type) -> torch.Tensor:
        """The whole model's gradient norm from each stage's."""
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.group)
            return norm
        total = norm.double() ** norm_type
        dist.all_reduce(total, group=self.group)
        return (total ** (1.0 / norm_type)).to(norm.dtype)
