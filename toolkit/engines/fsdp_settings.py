"""The fsdp engine's settings, in Accelerate's own forms: `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))`,
or a profile's `fsdp_config` (which `accelerate launch` and `toolkit launch` hand to the processes as Accelerate's
FSDP_* variables, read by Accelerate's own plugin, as an Accelerator reads them). Every field FSDP2 has is honoured
with Accelerate's meaning (accelerate/utils/fsdp_utils.py, `fsdp2_prepare_model` and `fsdp2_apply_ac`):

    reshard_after_forward     free each unit's gathered weights after its forward (False: keep them for backward)
    cpu_offload               keep the shards and their optimizer state in CPU memory (CPUOffloadPolicy)
    mixed_precision_policy    FSDP2's MixedPrecisionPolicy (else the engine's mixed_precision decides)
    auto_wrap_policy          which modules are their own unit: transformer_based_wrap (the classes named, else the
                              model's `_no_split_modules`), size_based_wrap (more than min_num_params), no_wrap (the
                              root only), or an FSDP1-style policy callable
    activation_checkpointing  recompute the units the wrap policy picks in backward
    state_dict_type           FULL_STATE_DICT (save_state writes the full weights) or SHARDED_STATE_DICT (each rank
                              its shards); the full state dict's rank0_only says whether other ranks receive it too
    cpu_ram_efficient_loading only rank 0 holds real weights: the others may build the model on the meta device
    ignored_modules           kept whole on every rank (averaged as DDP averages them, as the engine's scalars are)

A plugin of FSDP1 (fsdp_version 1, Accelerate's default outside a profile) is read as `accelerate to-fsdp2`
converts one: its sharding strategy becomes reshard_after_forward. A field FSDP2 has no meaning for, set away from
its default, is refused in one sentence naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError

# FSDP1 sharding strategies as `accelerate to-fsdp2` converts them (accelerate/commands/to_fsdp2.py); the hybrid
# ones need a two-dimensional mesh and NO_SHARD is DDP, so those are refused instead.
RESHARD_OF_STRATEGY = {"FULL_SHARD": True, "SHARD_GRAD_OP": False}
ELSEWHERE = {"NO_SHARD": "the ddp engine (--engine ddp)",
             "HYBRID_SHARD": "the accelerate engine on GPUs (a 2-D mesh)",
             "_HYBRID_SHARD_ZERO2": "the accelerate engine on GPUs (a 2-D mesh)"}
# FSDP1-only fields, with the value that means "not used": any other value is refused.
FSDP1_ONLY = {"backward_prefetch": None, "forward_prefetch": False, "limit_all_gathers": True, "param_init_fn": None}


@dataclass
class FSDPSettings:
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    mixed_precision_policy: object = None  # a MixedPrecisionPolicy, or None: from the engine's mixed_precision
    wrap: object = None  # (module) -> bool: which modules are their own unit; None: the root only
    activation_checkpointing: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    rank0_only: bool = True  # the full state dict goes to the main process only (else to every rank)
    offload_to_cpu: bool = True  # the full state dict's tensors in CPU memory
    cpu_ram_efficient_loading: bool = False
    ignored_modules: object = None  # None, a regex over module names, or modules

    @property
    def checkpoint_format(self) -> str:
        return "sharded" if self.state_dict_type == "SHARDED_STATE_DICT" else "full"


def _name(value) -> str:
    """An enum of torch's (ShardingStrategy, StateDictType) or a string, as its upper-case name."""
    return str(getattr(value, "name", value)).upper()


def read_plugin(plugin) -> FSDPSettings:
    """The settings of an Accelerate `FullyShardedDataParallelPlugin` (already resolved by its __post_init__, which
    also read the FSDP_* variables of a profile)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy

    for field, unused in FSDP1_ONLY.items():
        if field == "param_init_fn" and plugin.sync_module_states:
            continue  # Accelerate's own, for sync_module_states: FSDP2 starts every rank from rank 0's weights anyway
        if getattr(plugin, field, unused) not in (unused, None):
            raise UserError(f"the fsdp engine runs FSDP2, which has no {field} (an FSDP1 setting of "
                            f"FullyShardedDataParallelPlugin); leave it unset.")
    if plugin.activation_checkpointing_offload:
        raise UserError("the fsdp engine does not offload checkpointed activations (activation_checkpointing_offload); "
                        "leave it unset, or use the accelerate engine on GPUs for it.")
    reshard = plugin.reshard_after_forward
    if int(plugin.fsdp_version) == 1:
        strategy = _name(plugin.sharding_strategy or reshard or "FULL_SHARD")
        if strategy in ELSEWHERE:
            raise UserError(f"the fsdp engine shards over one dimension and cannot run sharding_strategy {strategy}; "
                            f"use {ELSEWHERE[strategy]}.")
        reshard = RESHARD_OF_STRATEGY[strategy]
    state_dict_type = _name(plugin.state_dict_type)
    if state_dict_type not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        raise UserError(f"the fsdp engine saves FULL_STATE_DICT or SHARDED_STATE_DICT, not state_dict_type "
                        f"{state_dict_type} (an FSDP1 format).")
    policy = plugin.mixed_precision_policy
    if isinstance(policy, MixedPrecision):  # FSDP1's: FSDP2 casts parameters and gradients, not buffers
        if policy.buffer_dtype not in (None, policy.param_dtype):
            raise UserError("the fsdp engine runs FSDP2, which does not cast buffers (mixed_precision_policy's "
                            "buffer_dtype); leave it unset or equal to param_dtype.")
        policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    offload = plugin.cpu_offload
    config = plugin.state_dict_config
    return FSDPSettings(
        reshard_after_forward=bool(reshard),
        cpu_offload=isinstance(offload, CPUOffloadPolicy) or bool(getattr(offload, "offload_params", False)),
        mixed_precision_policy=policy,
        wrap=_wrap_rule(plugin),
        activation_checkpointing=bool(plugin.activation_checkpointing),
        state_dict_type=state_dict_type,
        rank0_only=bool(getattr(config, "rank0_only", True)),
        offload_to_cpu=bool(getattr(config, "offload_to_cpu", True)),
        cpu_ram_efficient_loading=bool(plugin.cpu_ram_efficient_loading),
        ignored_modules=plugin.ignored_modules,
    )


def settings_from_profile() -> FSDPSettings:
    """What an Accelerator builds when a profile asks for FSDP and no plugin is given: Accelerate's plugin, which
    reads the FSDP_* variables the launcher set from the profile's fsdp_config."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    try:
        plugin = FullyShardedDataParallelPlugin()
    except ValueError as error:  # Accelerate's own check of the values
        raise UserError(f"accelerate rejected the profile's fsdp_config: {' '.join(str(error).split())}") from None
    return read_plugin(plugin)


def _wrap_rule(plugin):
    """The plugin's auto_wrap_policy as a rule `rule(model)` -> `(module) -> bool`, or None (the root only)."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    fn = plugin.auto_wrap_policy
    fn = getattr(fn, "func", fn)  # a functools.partial
    if fn is None:
        return None
    if fn is transformer_auto_wrap_policy:
        return lambda model: _by_class(model, plugin.transformer_cls_names_to_wrap)
    if fn is size_based_auto_wrap_policy:
        least = int(plugin.min_num_params or 0)
        return lambda model: (lambda module: sum(p.numel() for p in module.parameters()) > least)
    if callable(fn):  # FSDP1's policy protocol: asked with recurse=False, "is this module its own unit?"
        policy = plugin.auto_wrap_policy
        return lambda model: (lambda module: bool(policy(module=module, recurse=False,
                                                         nonwrapped_numel=sum(p.numel() for p in module.parameters()))))
    raise UserError(f"the fsdp engine takes auto_wrap_policy transformer_based_wrap, size_based_wrap, no_wrap or a "
                    f"policy function, not {type(fn).__name__}.")


def _by_class(model: nn.Module, names):
    """Accelerate's transformer_based_wrap: the classes named, else those the model's `_no_split_modules` names (the
    transformers convention); a name the model does not have is refused."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    if names is None:
        names = [n for n in getattr(model, "_no_split_modules", None) or [] if n in present]
    missing = [n for n in names if n not in present]
    if missing:
        raise UserError(f"transformer_cls_names_to_wrap names {', '.join(missing)}, which the model does not have "
                        f"(it has {', '.join(sorted(present))}).")
    classes = tuple(present[n] for n in names)
    return lambda module: bool(classes) and isinstance(module, classes)


def wrapped_units(model: nn.Module, rule) -> list[nn.Module]:
    """The modules that become their own FSDP unit under `rule`, innermost first (each before any module that
    contains it), the root left out: it is always sharded last. A ModuleList or ModuleDict has no forward and
    cannot be one (fully_shard refuses it): its members can."""
    picks = rule(model)
    return [m for m in list(model.modules())[:0:-1] if not isinstance(m, (nn.ModuleList, nn.ModuleDict)) and picks(m)]


def ignored_parameters(model: nn.Module, ignored) -> list[nn.Parameter]:
    """The parameters of the plugin's ignored_modules: a regex matched in full against module names, or modules."""
    if ignored is None:
        return []
    if isinstance(ignored, str):
        modules = [m for name, m in model.named_modules() if re.fullmatch(ignored, name)]
    else:
        modules = list(ignored)
    return [p for m in modules for p in m.parameters()]


def mixed_precision_dtype(settings: FSDPSettings | None, engine_dtype: torch.dtype | None):
    """The dtype the sharded units compute in: the plugin policy's param_dtype, else the engine's."""
    if settings is not None and settings.mixed_precision_policy is not None:
        return settings.mixed_precision_policy.param_dtype
    return engine_dtype


def to_meta(model: torch.nn.Module) -> dict:
    """Move the model's parameters and persistent buffers to the meta device in place, a tied parameter staying
    tied (Module.to would make one new parameter per place it is registered). Returns old parameter -> new."""
    moved = {}
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None:
                if param not in moved:
                    moved[param] = torch.nn.Parameter(torch.empty_like(param, device="meta"), param.requires_grad)
                module._parameters[key] = moved[param]
        for key, buffer in module._buffers.items():
            if buffer is not None and key not in module._non_persistent_buffers_set:
                module._buffers[key] = torch.empty_like(buffer, device="meta")
    return moved


def non_persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}".lstrip("."): buffer for name, module in model.named_modules()
            for key, buffer in module._buffers.items()
            if buffer is not None and key in module._non_persistent_buffers_set}


def fp32_norms(model: nn.Module, param_dtype) -> list[nn.Module]:
    """The BatchNorm layers that compute in fp32 under a lower param_dtype, as FSDP1's mixed precision left them by
    default: each a unit of its own that FSDP2 does not cast, handing on the compute dtype (CPU's kernel takes bf16
    activations with fp32 weights and statistics, not bf16 weights with fp32 statistics)."""
    if param_dtype in (None, torch.float32):
        return []
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m is not model]
