"""`save_state` / `load_state` and the rest of Accelerate's checkpoint calls for the plain-PyTorch engines.

The folder is Accelerate's own (toolkit/checkpoint/folder.py): a real `Accelerator.load_state` restores what
these engines save in the full format, and they restore what it saves. A full save gathers what every rank
holds (the full weights and optimizer state under fsdp, every rank's RNG streams), then the main process writes
the folder and publishes it atomically; a sharded save (`checkpoint_format = "sharded"`) has every rank write
its own shards instead (toolkit/checkpoint/sharded.py). Either way the other ranks learn whether it worked,
so a failed save stops every rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.config import listing
from toolkit.errors import UserError
from toolkit.engines.collectives import all_ranks
from toolkit.checkpoint.full import load_full_weights, write_full_weights
from toolkit.checkpoint.files import (CUSTOM_FILE, SCALER_NAME, custom_file, load_safe, read_state_json,
                                         restore_rng, rng_file, rng_state, state_file, state_json_text,
                                         training_state, write_training_state)
from toolkit.checkpoint.folder import (MANIFEST_NAME, building, check_checkpoint_format, checkpoint_format,
                                          remove_folder, verify_folder)
from toolkit.checkpoint.weights import one_name_per_storage, save_safetensors

# What save_state may replace: the files a checkpoint folder holds (sharded: torch.distributed.checkpoint's).
_CHECKPOINT_FILE = re.compile(r"(model|optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.(safetensors|bin)|"
                              r"scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|state\.json|"
                              r"manifest\.json|pytorch_model(_\d+)?\.bin|\.metadata|__\d+_\d+\.distcp")
_ITERATION = re.compile(r"checkpoint_(\d+)")


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
                    make_room(final, self.project_configuration)
                    self._write_state(final, weights, optimizers, rng_states, safe_serialization)
        self.project_configuration.iteration += 1
        return str(final)

    def _write_state(self, final, weights, optimizers, rng_states, safe_serialization):
        position = self._training_position()
        state_text = state_json_text(position)  # fails before gigabytes are written
        with building(final, {"checkpoint_format": "full", "step": position["step"],
                              "world_size": self.num_processes}) as temp:
            write_full_weights(temp, weights, optimizers, safe_serialization)
            write_training_state(temp, state_text, schedulers=self._schedulers, scaler=self.scaler,
                                 rng_states=rng_states, custom_objects=self._custom_objects)

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
        path = load_source(self.project_configuration, input_dir)
        if (path / MANIFEST_NAME).is_file():
            verify_folder(path)
        for hook in self._load_state_pre_hooks.values():
            hook(self._models, str(path))
        if checkpoint_format(path) == "sharded":
            from toolkit.checkpoint.sharded import load_shards  # torch.distributed.checkpoint: ~1 s to import

            load_shards(path, self._models, self._optimizers)
        else:
            load_full_weights(path, self._models, self._optimizers, strict=load_model_func_kwargs.get("strict", True))
        self.step = load_training_state(self, path, self.step)
        state = read_state_json(path)
        self.optimizer_steps = saved_optimizer_steps(state, self.optimizer_steps)
        for loader, position in zip(self._dataloaders, state.get("dataloaders", [])):
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
            _write_weights(state_dict, Path(save_directory), max_shard_size, safe_serialization)
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
    """Every rank: the sharded save_state of `engine` (its `_models`, `_optimizers`, `_schedulers`, `scaler`,
    `_custom_objects`: an Accelerator's registries too). Each rank writes its shards of the models and
    optimizers; the main process the rest, `rng_states` (every rank's, in order) and `position()` as state.json.
    `hooks` are the save_state pre-hooks, called with the shards' state dicts."""
    from toolkit.checkpoint.sharded import local_state_dicts, save_sharded  # imported when first used: ~1 s

    model_states, optimizer_states = local_state_dicts(engine._models, engine._optimizers)
    for hook in hooks:
        hook(engine._models, model_states, str(final))
    state_text, about = None, None
    with all_ranks(engine):  # refused on the main process before any rank writes a shard
        if engine.is_main_process:
            make_room(final, engine.project_configuration)
            state = position()
            state_text = state_json_text(state)
            about = {"checkpoint_format": "sharded", "step": state["step"], "world_size": engine.num_processes}

    def finish(temp):
        write_training_state(temp, state_text, schedulers=engine._schedulers, scaler=engine.scaler,
                             rng_states=rng_states, custom_objects=engine._custom_objects)

    with all_ranks(engine):  # a shard or file that could not be written stops every rank, said once
        save_sharded(final, model_states, optimizer_states, finish, about)


def load_training_state(engine, path: Path, step: int) -> int:
    """Load what every format holds besides the weights into `engine`'s schedulers, scaler and registered
    objects, restore this rank's RNG streams, and return the engine step they were saved at (else `step`)."""
    for i, scheduler in enumerate(engine._schedulers):
        scheduler.load_state_dict(load_safe(state_file(path, "scheduler", i, "bin")))
    if engine.scaler is not None and (path / SCALER_NAME).is_file():
        engine.scaler.load_state_dict(load_safe(path / SCALER_NAME))
    found = sorted(p.name for p in path.iterdir() if CUSTOM_FILE.fullmatch(p.name))
    if len(found) != len(engine._custom_objects):
        raise UserError(f"{path} holds {len(found)} registered object(s) but {len(engine._custom_objects)} are "
                        f"registered with register_for_checkpointing; register the same objects as when it was saved.")
    for i, obj in enumerate(engine._custom_objects):
        obj.load_state_dict(load_safe(path / custom_file(i)))
    saved = restore_rng(path, engine.process_index)
    if saved is None and (path / rng_file(0)).is_file():  # a grown world: rank 0's streams were saved at the same step
        saved = load_safe(path / rng_file(0))
    return int(saved["step"]) if isinstance(saved, dict) and "step" in saved else step


def saved_optimizer_steps(state: dict, steps: int) -> int:
    """The optimizer steps state.json says were taken, where its `step` is one: a folder that has `micro_step`
    beside it. Older folders' `step` was the micro-step counter, and Accelerate's own have no state.json: then
    `steps`, the count as it stands."""
    return int(state["step"]) if "micro_step" in state and "step" in state else steps


def load_source(config, input_dir) -> Path:
    """Where load_state reads: `input_dir`, or with automatic naming the newest project_dir/checkpoints/checkpoint_<i>."""
    if input_dir is not None:
        path = Path(input_dir)
        if not path.is_dir():
            raise UserError(f"load_state: {path} is not a folder; pass the folder save_state wrote.")
        return path
    if not config.automatic_checkpoint_naming:
        raise UserError("load_state needs an input_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
    root = Path(_project_dir_or_refuse(config, "load_state")) / "checkpoints"
    folders = sorted((int(m[1]), p) for p in (root.iterdir() if root.is_dir() else ())
                     if (m := _ITERATION.fullmatch(p.name)))
    if not folders:
        raise UserError(f"load_state: no checkpoint_<n> folder in {root}.")
    return folders[-1][1]


def destination(config, output_dir) -> Path:
    """Where save_state writes: `output_dir`, or with automatic naming project_dir/checkpoints/checkpoint_<i>."""
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise UserError("save_state needs an output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
        return Path(output_dir)
    return Path(_project_dir_or_refuse(config, "save_state")) / "checkpoints" / f"checkpoint_{config.iteration}"


def make_room(final: Path, config):
    """On the main process before a save: an automatic name already taken is refused; Accelerate's total_limit
    removes the oldest checkpoint_<n> folders so the new one fits; a folder holding other files is refused."""
    if config.automatic_checkpoint_naming:
        if final.exists():
            raise UserError(f"checkpoint folder {final} already exists; set accelerator.project_configuration.iteration "
                            f"to the iteration to continue from.")
        _prune(final.parent, config.total_limit)
    _refuse_foreign_files(final)


def _project_dir_or_refuse(config, call):
    if config.project_dir is None:
        raise UserError(f"{call} with automatic checkpoint naming needs project_dir= (or a ProjectConfiguration).")
    return config.project_dir


def _prune(root: Path, limit):
    if limit is None or not root.is_dir():
        return
    folders = sorted((int(m[1]), p) for p in root.iterdir() if (m := _ITERATION.fullmatch(p.name)))
    for _, path in folders[: max(0, len(folders) + 1 - limit)]:
        remove_folder(path)


def _refuse_foreign_files(final: Path):
    """save_state replaces its folder whole: refuse one that holds anything but a checkpoint's files."""
    if not final.exists():
        return
    if not final.is_dir():
        raise UserError(f"save_state: {final} is a file, not a folder; pass a folder of its own.")
    foreign = sorted(p.name for p in final.iterdir() if not _CHECKPOINT_FILE.fullmatch(p.name))
    if foreign:
        raise UserError(f"save_state would replace {final}, which holds files that are not a checkpoint's "
                        f"({listing(foreign, 3)}); save into a folder of its own.")


def _write_weights(state_dict, directory: Path, max_shard_size, safe_serialization: bool):
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    directory.mkdir(parents=True, exist_ok=True)
    state_dict = one_name_per_storage(state_dict)  # tied weights once, contiguous, on the CPU
    pattern = "model{suffix}.safetensors" if safe_serialization else "pytorch_model{suffix}.bin"
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name] for name in names}
        if safe_serialization:
            save_safetensors(shard, directory / filename)
        else:
            torch.save(shard, directory / filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        (directory / name).write_text(json.dumps(index, indent=2) + "\n")
