"""How the plain-PyTorch engines meet Accelerate's own settings and state: the Accelerator(...) keywords and
kwargs handlers they read (without importing accelerate), the ones they refuse in one sentence naming the
accelerate engine, the attributes that belong to Accelerate-only features, and the process state that
accelerate's module-level helpers read, made over the engine's world when the script uses them.
"""

from __future__ import annotations

import contextlib
import sys

from toolkit.errors import UserError

# Accelerator(...) settings a plain-PyTorch engine cannot honour: refused (with a non-default value) in one sentence.
ACCELERATE_ONLY = ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin", "torch_tp_plugin", "megatron_lm_plugin",
                   "parallelism_config")
# Accelerator attributes that belong to features these engines do not run: reading one is refused in one
# sentence (an AttributeError too, so hasattr() stays False), never a bare AttributeError.
ACCELERATE_ONLY_ATTRIBUTES = ("state", "gradient_state", "deepspeed_engine_wrapped", "deepspeed_config",
                              "deepspeed_plugins", "fsdp_plugin", "megatron_lm_plugin", "torch_tp_plugin",
                              "dynamo_plugin", "lomo_backward", "maybe_context_parallel",
                              "deepspeed_ulysses_dl_adapter", "fp8_recipe_handler", "ao_recipe_handler",
                              "te_recipe_handler", "has_fp8_handler", "autocast_handler", "scaler_handler")
HANDLERS = ("DistributedDataParallelKwargs", "GradScalerKwargs", "InitProcessGroupKwargs", "ProfileKwargs",
            "AutocastKwargs")


class NotOnThisEngine(UserError, AttributeError):
    """An Accelerator attribute the engine does not offer: one sentence naming the engine that does."""


class AccelerateSettingsMixin:
    """Needs from the engine: `name`, `num_processes`, `process_index`, `is_main_process`."""

    multi_device = property(lambda self: self.num_processes > 1)
    should_save_model = property(lambda self: self.is_main_process)
    is_fsdp2 = False  # the fsdp engine says True
    data_parallel_rank = data_parallel_shard_rank = property(lambda self: self.process_index)
    # What Accelerate's settings read as here: one data-parallel dimension, even seeded loaders.
    tensor_parallel_rank = pipeline_parallel_rank = context_parallel_rank = 0
    even_batches, dispatch_batches, use_seedable_sampler, non_blocking = True, False, True, False
    # Accelerate's property: DataLoaderConfiguration(use_stateful_dataloader=True), which the prepared loaders honour
    use_stateful_dataloader = property(lambda self: bool(getattr(self.dataloader_config, "use_stateful_dataloader", False)))
    parallelism_config = torch_device_mesh = deepspeed_plugin = fp8_backend = None
    is_composable_parallelism_enabled = False

    def join_uneven_inputs(self, joinables, even_batches=None):
        """A no-op: these engines' loaders always give every rank as many batches (sampler padding)."""
        return contextlib.nullcontext()

    def verify_device_map(self, model) -> bool:
        return False  # no big-model device map: each engine places the whole model itself

    def _refuse_accelerate_only(self, settings: dict):
        unknown = [k for k in settings if k not in ACCELERATE_ONLY]
        if unknown:
            raise TypeError(f"Accelerator() got unexpected keyword argument(s) {', '.join(unknown)}")
        given = [k for k, v in settings.items() if v is not None]
        if given == ["fsdp_plugin"]:
            raise UserError(f"the {self.name} engine cannot honour Accelerator(fsdp_plugin=...); use the fsdp engine "
                            f"(--engine fsdp) or the accelerate engine (--engine accelerate) for it.")
        if given:
            raise UserError(f"the {self.name} engine cannot honour Accelerator({', '.join(given)}=...); use the "
                            f"accelerate engine (--engine accelerate) for it.")

    def _read_handlers(self, handlers, timeout):
        """Accelerate's kwargs handlers, read by class name (this engine does not import accelerate)."""
        self.ddp_handler, self.profile_handler, self._scaler_kwargs, self._autocast_kwargs = None, None, {}, {}
        self.timeout = timeout
        for handler in handlers:
            kind = type(handler).__name__
            if kind not in HANDLERS:
                raise UserError(f"the {self.name} engine does not take {kind} in kwargs_handlers (it takes "
                                f"{', '.join(HANDLERS)}); use the accelerate engine (--engine accelerate) for it.")
            if kind == "DistributedDataParallelKwargs":
                self.ddp_handler = handler
            elif kind == "ProfileKwargs":
                self.profile_handler = handler
            elif kind == "GradScalerKwargs":
                self._scaler_kwargs = handler.to_kwargs()
            elif kind == "AutocastKwargs":
                self._autocast_kwargs = handler.to_kwargs()
            elif timeout is None and getattr(handler, "timeout", None) is not None:  # InitProcessGroupKwargs
                self.timeout = handler.timeout.total_seconds()

    def __getattr__(self, name):
        # Only reached for names not defined: an Accelerator attribute of a feature this engine does not run.
        if name in ACCELERATE_ONLY_ATTRIBUTES:
            raise NotOnThisEngine(f"the {self.name} engine has no Accelerator.{name} (it belongs to a feature only "
                                  f"Accelerate runs); use the accelerate engine (--engine accelerate) for it.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def share_state_with_accelerate(engine):
    """A script that imports accelerate may call its module-level helpers (`set_seed(device_specific=True)`,
    `gather_object`, `save`): they read Accelerate's process state, which an Accelerator would have made. Make it
    over the engine's world (its group already formed). A script that never imported accelerate pays nothing."""
    if "accelerate" not in sys.modules:
        return
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin

    if AcceleratorState._shared_state:  # an Accelerator (or an earlier engine) made it: it stays as it is
        return
    engine._made_accelerate_state = True
    AcceleratorState(mixed_precision=engine.mixed_precision, cpu=engine.device.type == "cpu",
                     dynamo_plugin=TorchDynamoPlugin(backend="no"), _from_accelerator=True)


def release_accelerate_state(engine):
    """At end_training, forget the state share_state_with_accelerate made, as a finished Accelerator's process
    would: a notebook can then run accelerate's notebook_launcher, which refuses while any state exists."""
    if getattr(engine, "_made_accelerate_state", False):
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        engine._made_accelerate_state = False
