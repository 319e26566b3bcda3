"""`save_state` / `load_state` and the rest of Accelerate's checkpoint calls for the plain-PyTorch engines.

The folder is Accelerate's own (toolkit/engines/state_folder.py): a real `Accelerator.load_state` restores what
these engines save, and they restore what it saves. A save gathers what every rank holds (the full weights
and optimizer state under fsdp, every rank's RNG streams), then the main process writes the folder and
publishes it atomically; the other ranks learn whether it worked, so a failed save stops every rank.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit import errors
from toolkit.errors import UserError
from toolkit.engines import state_folder as folder_format

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
    `scaler`, `step`, `project_configuration`, `get_state_dict`, `unwrap_model`, `gather_object`."""

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
        and the registered objects, in Accelerate's layout plus state.json and manifest.json. Every rank calls it."""
        final = destination(self.project_configuration, output_dir)
        weights = [self.get_state_dict(model) for model in self._models]  # collectives under fsdp
        optimizers = [optimizer.state_dict() for optimizer in self._optimizers]
        rng_states = self.gather_object([folder_format.rng_state(self.step)])
        for hook in self._save_state_pre_hooks.values():
            hook(self._models, weights, str(final))
        with errors.all_ranks(self):  # a save the main process cannot write stops every rank, said once
            if self.is_main_process:
                make_room(final, self.project_configuration)
                self._write_state(final, weights, optimizers, rng_states, safe_serialization)
        self.project_configuration.iteration += 1
        return str(final)

    def _write_state(self, final, weights, optimizers, rng_states, safe_serialization):
        from toolkit.models.weights import save_model

        temp = folder_format.start_folder(final)
        try:
            for i, state in enumerate(weights):
                if safe_serialization:
                    save_model(state, temp / folder_format.indexed("model", i, "safetensors"))
                else:
                    torch.save(dict(state), temp / folder_format.indexed("pytorch_model", i, "bin"))
            for i, state in enumerate(optimizers):
                folder_format.save_checked(state, temp / folder_format.indexed("optimizer", i, "bin"))
            for i, scheduler in enumerate(self._schedulers):
                folder_format.save_checked(scheduler.state_dict(), temp / folder_format.indexed("scheduler", i, "bin"))
            if self.scaler is not None:
                folder_format.save_checked(self.scaler.state_dict(), temp / folder_format.SCALER_NAME)
            for rank, state in enumerate(rng_states):
                folder_format.save_checked(state, temp / folder_format.rng_file(rank))
            for i, obj in enumerate(self._custom_objects):
                folder_format.save_checked(obj.state_dict(), temp / folder_format.custom_file(i))
            state = self._training_position()
            folder_format.write_state_json(temp, state)
            folder_format.seal(temp, {"checkpoint_format": "full", "step": self.step, "world_size": self.num_processes})
            folder_format.publish(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

    def _training_position(self) -> dict:
        """The toolkit's additions: where training stands and which world saved it."""
        return {"step": self.step, "iteration": self.save_iteration, "engine": self.name,
                "world_size": self.num_processes, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "dataloaders": [loader.position() for loader in self._dataloaders]}

    # -- load --------------------------------------------------------------------------------------------
    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Accelerate's load_state: restores everything save_state wrote (or a real Accelerator's save_state),
        verified against manifest.json when the folder has one. Every rank calls it."""
        from toolkit.models.weights import load_model

        path = self._load_dir(input_dir)
        if (path / folder_format.MANIFEST_NAME).is_file():
            folder_format.verify_folder(path)
        for hook in self._load_state_pre_hooks.values():
            hook(self._models, str(path))
        for i, model in enumerate(self._models):
            file = path / folder_format.indexed("model", i, "safetensors")
            if not file.is_file():
                file = path / folder_format.indexed("pytorch_model", i, "bin")
                file = folder_format.load_safe(file) if file.is_file() else file
            load_model(model, file, strict=load_model_func_kwargs.get("strict", True))
        for i, optimizer in enumerate(self._optimizers):
            optimizer.load_state_dict(folder_format.load_safe(path / folder_format.indexed("optimizer", i, "bin")))
        for i, scheduler in enumerate(self._schedulers):
            scheduler.load_state_dict(folder_format.load_safe(path / folder_format.indexed("scheduler", i, "bin")))
        if self.scaler is not None and (path / folder_format.SCALER_NAME).is_file():
            self.scaler.load_state_dict(folder_format.load_safe(path / folder_format.SCALER_NAME))
        self._load_custom_objects(path)
        state = folder_format.read_state_json(path)
        self._restore_rng(path, state)
        for loader, position in zip(self._dataloaders, state.get("dataloaders", [])):
            loader.set_position(position)

    def _load_dir(self, input_dir) -> Path:
        if input_dir is not None:
            path = Path(input_dir)
            if not path.is_dir():
                raise UserError(f"load_state: {path} is not a folder; pass the folder save_state wrote.")
            return path
        if not self.project_configuration.automatic_checkpoint_naming:
            raise UserError("load_state needs an input_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
        root = Path(_project_dir_or_refuse(self.project_configuration, "load_state")) / "checkpoints"
        folders = sorted((int(m[1]), p) for p in (root.iterdir() if root.is_dir() else ())
                         if (m := _ITERATION.fullmatch(p.name)))
        if not folders:
            raise UserError(f"load_state: no checkpoint_<n> folder in {root}.")
        return folders[-1][1]

    def _load_custom_objects(self, path):
        found = sorted(p.name for p in path.iterdir() if folder_format.CUSTOM_FILE.fullmatch(p.name))
        if len(found) != len(self._custom_objects):
            raise UserError(f"{path} holds {len(found)} registered object(s) but {len(self._custom_objects)} are "
                            f"registered with register_for_checkpointing; register the same objects as when it was saved.")
        for i, obj in enumerate(self._custom_objects):
            obj.load_state_dict(folder_format.load_safe(path / folder_format.custom_file(i)))

    def _restore_rng(self, path, state):
        file = path / folder_format.rng_file(self.process_index)
        if not file.is_file():  # the world grew since the save: this rank keeps its seeded streams
            print(f"[toolkit] {path} has no RNG state for rank {self.process_index}: it keeps its seeded RNG.",
                  file=sys.stderr)
            self.step = int(state.get("step", self.step))
            return
        saved = folder_format.load_safe(file)
        try:
            folder_format.set_rng_state(saved)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:  # a crafted or foreign file
            raise UserError(f"Checkpoint {path} is corrupt: {file.name} does not hold RNG states "
                            f"({type(error).__name__}: {error}).") from None
        self.step = int(saved.get("step", state.get("step", self.step)))

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
            import safetensors.torch

            from toolkit.models.weights import _one_name_per_storage

            safetensors.torch.save_file(_one_name_per_storage(obj), str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)


def _register(hooks: dict, hook):
    from torch.utils.hooks import RemovableHandle

    handle = RemovableHandle(hooks)
    hooks[handle.id] = hook
    return handle


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
        folder_format.remove_folder(path)


def _refuse_foreign_files(final: Path):
    """save_state replaces its folder whole: refuse one that holds anything but a checkpoint's files."""
    if not final.exists():
        return
    if not final.is_dir():
        raise UserError(f"save_state: {final} is a file, not a folder; pass a folder of its own.")
    foreign = sorted(p.name for p in final.iterdir() if not _CHECKPOINT_FILE.fullmatch(p.name))
    if foreign:
        raise UserError(f"save_state would replace {final}, which holds files that are not a checkpoint's "
                        f"({', '.join(foreign[:3])}); save into a folder of its own.")


def _write_weights(state_dict, directory: Path, max_shard_size, safe_serialization: bool):
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    from toolkit.models.weights import _one_name_per_storage

    directory.mkdir(parents=True, exist_ok=True)
    state_dict = _one_name_per_storage(state_dict)  # tied weights once, contiguous, on the CPU
    pattern = "model{suffix}.safetensors" if safe_serialization else "pytorch_model{suffix}.bin"
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name] for name in names}
        if safe_serialization:
            import safetensors.torch

            safetensors.torch.save_file(shard, str(directory / filename), metadata={"format": "pt"})
        else:
            torch.save(shard, directory / filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        (directory / name).write_text(json.dumps(index, indent=2) + "\n")
