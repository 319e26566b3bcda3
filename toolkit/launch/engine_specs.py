"""Every engine by name, with what starting and checking it needs to know: the launcher it pairs with, the world it
forms, whether it shards. `build_accelerator`, `toolkit launch` and `toolkit env` ask this table instead of spelling
engine names; the engines themselves live in toolkit/engines/, each imported only when chosen.

>>> spec = engine_spec("fsdp")
>>> (spec.launcher, spec.process_group, spec.shards)
('torchrun', True, True)
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class EngineSpec:
    name: str
    builds: str  # "module:Class", imported by build_accelerator only when chosen (ddp never imports accelerate)
    launcher: str  # what `toolkit launch` starts it under: "accelerate" (accelerate launch), "torchrun" or "python"
    shards: bool  # keeps 1/W of the model in each process under an FSDP profile; False: a whole copy in each
    every_gpu: bool = False  # one process drives every visible GPU, so a process count cannot apply
    accelerator: bool = False  # a real accelerate.Accelerator runs inside and keeps Accelerate's state itself
    fsdp_without_cuda: str | None = None  # the engine that trains an FSDP profile in its place where CUDA is missing

    @property
    def process_group(self) -> bool:
        """One process per device in a process group, on any number of machines; False: one process on one machine."""
        return self.launcher != "python"


ENGINE_SPECS = {spec.name: spec for spec in (
    EngineSpec("accelerate", "toolkit.engines.accelerate_engine:AccelerateEngine", "accelerate", shards=True,
               accelerator=True, fsdp_without_cuda="fsdp"),
    EngineSpec("ddp", "toolkit.engines.ddp:RawDDPEngine", "torchrun", shards=False),
    EngineSpec("dp", "toolkit.engines.dp:DataParallelEngine", "python", shards=False, every_gpu=True),
    EngineSpec("fsdp", "toolkit.engines.fsdp:FSDPEngine", "torchrun", shards=True),
    EngineSpec("single", "toolkit.engines.single:SingleEngine", "python", shards=False),
)}
LAUNCH_DEFAULT = "accelerate"  # `toolkit launch` and `toolkit parity` without --engine or TOOLKIT_ENGINE
# The engine `auto` picks for each launcher that `read_launch_env` recognises.
AUTO_BY_LAUNCHER = {
    "accelerate": "accelerate",
    "torchrun": "ddp",
    "torch.distributed.launch": "ddp",
    "spawn": "ddp",
    "slurm": "ddp",
    "azureml": "ddp",
    "pytorchjob": "ddp",
    "ray": "ddp",
    "mpi": "ddp",
    "python": "single",
}


def engine_spec(name: str) -> EngineSpec:
    """The table's row for `name`; an unknown name is a UserError listing the known ones."""
    if name not in ENGINE_SPECS:
        raise UserError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_SPECS)}.")
    return ENGINE_SPECS[name]


def engines_where(test) -> str:
    """The engines whose spec passes `test`, as `a, b or c` for a sentence that names them.

    >>> engines_where(lambda spec: spec.process_group)
    'accelerate, ddp or fsdp'
    """
    names = sorted(name for name, spec in ENGINE_SPECS.items() if test(spec))
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
