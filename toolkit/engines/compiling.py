"""Compilation as Accelerate does it in `prepare()`, for the plain-PyTorch engines: `Accelerator(dynamo_backend=...)`,
`Accelerator(dynamo_plugin=TorchDynamoPlugin(...))`, or a profile's `dynamo_config` (which `accelerate launch` and
`toolkit launch` hand over as Accelerate's ACCELERATE_DYNAMO_* variables, read by Accelerate's own plugin).

As in Accelerate (accelerate/accelerator.py, `prepare_model`): the model is compiled last, over the engine's
wrapper (`torch.compile(DDP(model))`), and `prepare` returns torch's compiled module. With
`use_regional_compilation`, each block of a repeated ModuleList is compiled in place instead, by Accelerate's own
`compile_regions_fsdp2` (what Accelerate does under FSDP2; in place on every engine here, so names and types stay).
A compiled model's state dict is saved without `_orig_mod.` (toolkit/checkpoint/weights.py strips it), so its
checkpoints load into an uncompiled model and back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from toolkit.errors import UserError


@dataclass
class CompileSettings:
    kwargs: dict = field(default_factory=dict)  # torch.compile's: backend, mode, fullgraph, dynamic, options
    regional: bool = False


def compile_settings(dynamo_backend, dynamo_plugin, from_profile: bool) -> CompileSettings | None:
    """What Accelerator(dynamo_backend=..., dynamo_plugin=...) asks for, else what the profile asks for; None: no
    compilation."""
    if dynamo_plugin is not None and dynamo_backend is not None:
        raise UserError("give dynamo_plugin or dynamo_backend, not both (Accelerate refuses the pair as well).")
    if dynamo_plugin is None and dynamo_backend is None and not from_profile:
        return None
    if dynamo_plugin is None:
        if str(getattr(dynamo_backend, "value", dynamo_backend) or "no").lower() == "no" and not from_profile:
            return None
        from accelerate.utils import TorchDynamoPlugin  # reads the profile's ACCELERATE_DYNAMO_* variables

        try:
            dynamo_plugin = TorchDynamoPlugin(backend=dynamo_backend)
        except ValueError as error:
            raise UserError(f"dynamo_backend {dynamo_backend!r} is not one of Accelerate's backends: "
                            f"{' '.join(str(error).split())}") from None
    if str(getattr(dynamo_plugin.backend, "value", dynamo_plugin.backend)).lower() == "no":
        return None
    return CompileSettings(dynamo_plugin.to_kwargs(), bool(dynamo_plugin.use_regional_compilation))


def compile_model(model: torch.nn.Module, settings: CompileSettings | None) -> torch.nn.Module:
    """The prepared model compiled as the settings say (unchanged without settings, or when already compiled)."""
    if settings is None or is_compiled(model):
        return model
    if settings.regional:
        from accelerate.utils.other import compile_regions_fsdp2

        return compile_regions_fsdp2(model, **settings.kwargs)
    return torch.compile(model, **settings.kwargs)


def is_compiled(model) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return bool(eval_frame) and isinstance(model, eval_frame.OptimizedModule)


def uncompiled(model):
    """The module inside torch.compile's wrapper (the engine's own wrapper: DDP, FSDP's root), or `model`."""
    return model._orig_mod if is_compiled(model) else model


def compiled_around(plain: torch.nn.Module, prepared) -> torch.nn.Module:
    """Accelerate's unwrap_model(keep_torch_compile=True): the compiled model over the plain module, the engine's
    wrapper gone. torch's compiled wrapper itself where it holds the plain module (single; inside dp's
    DataParallel); over the engine's wrapper (DDP, FSDP's root: the same module) a new one with its compile
    settings, where Accelerate re-points the prepared one's `_orig_mod`, which would leave it training without
    its DDP. The plain module where nothing was compiled."""
    layer = prepared
    while not is_compiled(layer) and isinstance(getattr(layer, "module", None), torch.nn.Module):
        layer = layer.module  # DataParallel, DDP
    if not is_compiled(layer):
        return plain
    return layer if layer._orig_mod is plain else type(layer)(plain, layer.dynamo_ctx)
