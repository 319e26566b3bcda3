"""`save_state` / `load_state` and the rest of Accelerate's checkpoint calls for the plain-PyTorch engines.

The engine hands over state dicts and its registries, and takes them back; toolkit/checkpoint/state.py writes
and reads the folder, which is Accelerate's own: a real `Accelerator.load_state` restores what these engines
save in the full format, and they restore what it saves. A full save gathers what every rank holds (the full
weights and optimizer state under fsdp, every rank's RNG streams), then the main process writes the folder and
publishes it atomically; a sharded save (`checkpoint_format = "sharded"`) has every rank write its own shards
instead. Either way the other ranks learn whether it worked (collectives.all_ranks), so a failed save stops
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.engines.collectives import all_ranks
from toolkit.checkpoint.files import check_checkpoint_format, rng_state, training_state
from toolkit.checkpoint.state import (Registries, begin_sharded, destination, open_for_load, read_rest, read_weights,
                                      saved_optimizer_steps, write_full, write_sharded)
from toolkit.checkpoint.weights import one_name_per_storage, save_safetensors, write_weights_folder


@dataclass
class ProjectConfiguration:
    """Accelerate's `ProjectConfiguration`, for engines that do not import accelerate (an Accelerate one is
    read the same way: by its attribute names)."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self):
        if self.logging_dir is None:
            self.logging_dir = self.project_dir


class CheckpointingMixin:
    """Needs from the engine: `_models`, `_optimizers`, `_schedulers`, `_dataloaders`, `_custom_objects`,
    `scaler`, `step`, `project_configuration`, `checkpoint_format` ("full" or "sharded"), `get_state_dict`,
    `unwrap_model`, `gather_object`."""

    # -- where -------------------------------------------------------------------------------------------
    @property
    def project_dir(self):
        return self.project_configuration.project_dir

    @property
    def logging_dir(self):
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    # -- save --------------------------------------------------------------------------------------------
    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Accelerate's save_state: models, optimizers, schedulers, the GradScaler, every rank's RNG streams
        and the registered objects, in Accelerate's layout plus state.json and manifest.json; models and
        optimizers whole, or as each rank's shards under checkpoint_format "sharded". Every rank calls it."""
        final = destination(self.project_configuration, output_dir)
        rng_states = self.gather_object([rng_state(self.step)])  # every rank's own streams
        if check_checkpoint_format(self.checkpoint_format) == "sharded":
            save_sharded_state(self, final, rng_states, self._save_state_pre_hooks.values(), self._training_position)
        else:
            weights = [self.get_state_dict(model) for model in self._models]  # collectives under fsdp
            optimizers = [optimizer.state_dict() for optimizer in self._optimizers]
            for hook in self._save_state_pre_hooks.values():
                hook(self._models, weights, str(final))
            with all_ranks(self):  # a save the main process cannot write stops every rank, said once
                if self.is_main_process:
                    write_full(final, self.project_configuration, self._training_position(), self.num_processes,
                               weights, optimizers, self._registries(), rng_states, safe_serialization)
        self.project_configuration.iteration += 1
        return str(final)

    def _registries(self) -> Registries:
        return Registries(self._schedulers, self.scaler, self._custom_objects)

    def _training_position(self) -> dict:
        return training_state(engine=self.name, step=self.optimizer_steps, micro_step=self.step,
                              iteration=self.save_iteration, world_size=self.num_processes, accumulation=self.gradient_accumulation_steps,
                              loaders=[loader.position() for loader in self._dataloaders],
                              registered=self._custom_objects)

    # -- load --------------------------------------------------------------------------------------------
    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Accelerate's load_state: restores everything save_state wrote (or a real Accelerator's save_state),
        verified against manifest.json when the folder has one; a sharded folder is resharded to this world
        size. Every rank calls it."""
        path = open_for_load(self.project_configuration, input_dir)
        for hook in self._load_state_pre_hooks.values():
            hook(self._models, str(path))
        read_weights(path, self._models, self._optimizers, strict=load_model_func_kwargs.get("strict", True))
        self.step, state = read_rest(path, self._registries(), self.process_index, self.step)
        self.optimizer_steps = saved_optimizer_steps(state, self.optimizer_steps)
        for loader, position in zip(self._dataloaders, state.get("dataloaders", [])):
            if loader.stateful:  # Accelerate's stateful loaders go on where they were, with no skip_first_batches
                loader.load_state_dict(position)
            else:
                loader.set_position(position)

    # -- registered objects and hooks ------------------------------------------------------------------
    def register_for_checkpointing(self, *objects):
        """Objects with state_dict/load_state_dict that save_state and load_state include (Accelerate's call)."""
        invalid = [type(obj).__name__ for obj in objects
                   if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)))]
        if invalid:
            raise UserError(f"register_for_checkpointing takes objects with state_dict and load_state_dict; "
                            f"{', '.join(invalid)} has neither or one of them.")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook):
        return _register(self._save_state_pre_hooks, hook)

    def register_load_state_pre_hook(self, hook):
        return _register(self._load_state_pre_hooks, hook)

    # -- weights ------------------------------------------------------------------------------------------
    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        """Accelerate's save_model: the full weights (gathered under fsdp) in `save_directory`, as
        model.safetensors or shards plus model.safetensors.index.json above `max_shard_size`. Every rank calls it."""
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            write_weights_folder(state_dict, Path(save_directory), max_shard_size, safe_serialization)
        self.wait_for_everyone()

    def save(self, obj, f, safe_serialization: bool = False):
        """torch.save (or safetensors) on the main process only, as Accelerate's save."""
        if not self.is_main_process:
            return
        if safe_serialization:
            save_safetensors(one_name_per_storage(obj), f)
        else:
            torch.save(obj, f)


def _register(hooks: dict, hook):
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


def save_sharded_state(engine, final: Path, rng_states, hooks, position):
    """Every rank: the sharded save_state of `engine` (its `_models`, `_optimizers` and `_registries()`: an
    Accelerator's registries too). Each rank writes its shards of the models and optimizers; the main process
    the rest, `rng_states` (every rank's, in order) and `position()` as state.json. `hooks` are the save_state
    pre-hooks, called with the shards' state dicts."""
    from toolkit.checkpoint.sharded import local_state_dicts  # imported when first used: ~1 s

    model_states, optimizer_states = local_state_dicts(engine._models, engine._optimizers)
    for hook in hooks:
        hook(engine._models, model_states, str(final))
    started = None
    with all_ranks(engine):  # refused on the main process before any rank writes a shard
        if engine.is_main_process:
            started = begin_sharded(final, engine.project_configuration, position(), engine.num_processes)
    with all_ranks(engine):  # a shard or file that could not be written stops every rank, said once
        write_sharded(final, model_states, optimizer_states, engine._registries(), rng_states, started)
