"""The device mesh of a ParallelismConfig, Accelerate's way of naming a run's dimensions (accelerate/parallelism_config.py):
`build_accelerator(parallelism_config=ParallelismConfig(...))`, Accelerate's own config where it can be built, or a
profile's `parallelism_config` keys, which `accelerate launch` and `toolkit launch` hand over as Accelerate's
PARALLELISM_CONFIG_* variables (`toolkit launch` also takes accelerate launch's `--parallelism_config_*_size` flags
over the profile's, and checks the mesh against the world before it starts any process).

The fsdp engine runs the data-parallel dimensions, tensor parallel and pipeline parallel: `dp_shard` alone is FSDP,
`dp_replicate` x `dp_shard` is HSDP (each shard group keeps 1/dp_shard of the model; the replicas average their
gradients), `tp` splits each layer by the plan the model declares (engines/tensor_parallel.py) and `pp` cuts it into
stages between its blocks (engines/pipeline.py), on a mesh named as Accelerate names it and exposed as
`accelerator.torch_device_mesh`. `pp_size`, `pp_schedule` and `pp_microbatches` are the toolkit's own fields, as
Accelerate has no pipeline parallel: `toolkit launch --parallelism-config-pp-size N` (and -pp-schedule, -pp-microbatches)
hands them over as PARALLELISM_CONFIG_PP_* variables. The context dimensions are refused in one sentence, before any
process trains, as is a mesh that does not tile the world.

    >>> config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    >>> mesh_shape(config, world=4, engine="fsdp")
    ((2, 2), ('dp_replicate', 'dp_shard'))
    >>> mesh_shape(ParallelismConfig(tp_size=2), world=2, engine="fsdp")
    ((1, 2), ('dp_shard', 'tp'))
    >>> mesh_shape(ParallelismConfig(pp_size=2, dp_shard_size=2), world=4, engine="fsdp")
    ((2, 2), ('pp', 'dp_shard'))
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError

SIZES = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size", "pp_size")
SCHEDULES = ("1f1b", "gpipe")


@dataclass
class ParallelismConfig:
    """Accelerate's ParallelismConfig fields, names and meaning, which need no transformers here, plus `pp_size`
    (pipeline stages: the toolkit's own, as Accelerate has no pipeline parallel). None means 1."""

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    sp_size: int | None = None
    pp_size: int | None = None
    pp_schedule: str = "1f1b"  # the toolkit's, as pp_size: "1f1b" or "gpipe" (torch.distributed.pipelining)
    pp_microbatches: int | None = None  # the slices a pipeline splits each batch into (None: pp_size)

    def __post_init__(self):
        for name in SIZES + ("pp_microbatches",):
            if name == "pp_microbatches" and self.pp_microbatches is None:
                continue
            value = 1 if getattr(self, name) is None else getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"ParallelismConfig's {name} must be a whole number of at least 1, not {value!r}.")
            setattr(self, name, value)
        self.pp_schedule = str(self.pp_schedule).lower()
        if self.pp_schedule not in SCHEDULES:
            raise UserError(f"ParallelismConfig's pp_schedule must be one of {', '.join(SCHEDULES)}, not "
                            f"{self.pp_schedule!r}.")
        self.pp_microbatches = self.pp_microbatches or self.pp_size

    @property
    def total_size(self) -> int:
        product = 1
        for name in SIZES:
            product *= getattr(self, name)
        return product


def read_parallelism_config(config) -> ParallelismConfig:
    """The toolkit's config, or Accelerate's read by its field names (it has no pp_size)."""
    if isinstance(config, ParallelismConfig):
        return config
    return ParallelismConfig(**{name: getattr(config, name, None) for name in SIZES},
                             pp_schedule=getattr(config, "pp_schedule", "1f1b"),
                             pp_microbatches=getattr(config, "pp_microbatches", None))


def mesh_shape(config: ParallelismConfig, world: int, engine: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The mesh's sizes and dimension names for `world` processes, in torchtitan's order (pp, dp_replicate, dp_shard,
    tp: the ranks of one tp group are neighbours, as on one node's fast links; pipeline stages are furthest apart,
    as their traffic is the least), or one sentence saying why it cannot run. With tp or pp, `dp_shard` is always a
    dimension (of size 1 when no data parallel is asked): FSDP2 shards over it."""
    others = [f"{name} {getattr(config, name)}" for name in ("cp_size", "sp_size") if getattr(config, name) > 1]
    if others:
        raise UserError(f"the {engine} engine runs the data-parallel, tensor-parallel and pipeline dimensions of a "
                        f"ParallelismConfig (dp_replicate_size, dp_shard_size, tp_size, pp_size), not "
                        f"{', '.join(others)}; context parallel runs under the accelerate engine on GPUs.")
    pp, replicate, shard, tp = config.pp_size, config.dp_replicate_size, config.dp_shard_size, config.tp_size
    if pp * replicate * shard * tp != world:
        raise UserError(f"the ParallelismConfig's mesh (pp {pp} x dp_replicate {replicate} x dp_shard {shard} x tp "
                        f"{tp} = {pp * replicate * shard * tp} processes) cannot tile this world of {world}; make "
                        f"the sizes multiply to {world}.")
    if replicate > 1 and shard == 1:
        raise UserError("dp_replicate_size alone replicates the whole model, which is DDP: use the ddp engine, or "
                        "give dp_shard_size as well (HSDP).")
    sizes = ([(pp, "pp")] if pp > 1 else []) + ([(replicate, "dp_replicate")] if replicate > 1 else [])
    sizes += [(shard, "dp_shard")] + ([(tp, "tp")] if tp > 1 else [])
    return tuple(size for size, _ in sizes), tuple(name for _, name in sizes)


def to_accelerate(config):
    """What a real Accelerator takes: Accelerate's own ParallelismConfig with the same sizes (the toolkit's pp_size
    has no counterpart there, so it is refused)."""
    if not isinstance(config, ParallelismConfig):
        return config
    if config.pp_size > 1:
        raise UserError(f"Accelerate has no pipeline parallel: the accelerate engine cannot run pp_size "
                        f"{config.pp_size}.")
    from accelerate.parallelism_config import ParallelismConfig as AcceleratesConfig

    return AcceleratesConfig(**{name: getattr(config, name) for name in SIZES if name != "pp_size"})


def mesh_story(sizes: dict) -> list[tuple[str, str]]:
    """What each rank of a mesh holds and what each step communicates, in words (`toolkit env`).

    >>> for label, text in mesh_story({"dp_shard": 2, "tp": 2, "pp": 1}): print(label, "|", text)
    each rank | 1/2 of each layer's weights (tp), then 1/2 of those (FSDP): 1/4 of the model's training state; reads 1/2 of each global batch
    each step | tp: 2 all-gathers and 2 reduce-scatters of the activations per block, forward and again backward; dp_shard: each block's weights all-gathered in forward and backward, its gradients reduce-scattered
    """
    pp, tp = sizes.get("pp", 1), sizes.get("tp", 1)
    replicate, shard = sizes.get("dp_replicate", 1), sizes.get("dp_shard", 1)
    holds = ([f"1/{pp} of the blocks (a pipeline stage)"] if pp > 1 else []) + (
        [f"1/{tp} of each layer's weights (tp)"] if tp > 1 else []) + (
        [f"1/{shard} of those (FSDP)" if pp > 1 or tp > 1 else f"1/{shard} of the weights (FSDP)"] if shard > 1 else [])
    state = pp * tp * shard
    holds_text = (", then ".join(holds) + (f": 1/{state} of the model's training state" if len(holds) > 1 else "")
                  if holds else "the whole model")
    talks = ([f"pp: each micro-batch's activations to the next stage and their gradients back; the bubble idles "
              f"(p-1)/(m+p-1) of a step ({pp - 1}/{pp + 1} with m = {pp} micro-batches)"] if pp > 1 else []) + (
        ["tp: 2 all-gathers and 2 reduce-scatters of the activations per block, forward and again backward"]
        if tp > 1 else []) + (
        ["dp_shard: each block's weights all-gathered in forward and backward, its gradients reduce-scattered"]
        if shard > 1 else []) + (
        [f"dp_replicate: the gradient shards all-reduced across the {replicate} replicas"] if replicate > 1 else [])
    return [("each rank", f"{holds_text}; reads 1/{replicate * shard} of each global batch"),
            ("each step", "; ".join(talks) or "nothing: one process")]
