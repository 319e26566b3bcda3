"""The one writer and the one reader of the folder `accelerator.save_state` makes, for every engine, and for
save_checkpoint, load_checkpoint and `toolkit checkpoint consolidate` (tests/test_layers.py checks that no other
module builds a folder or reads what it holds besides weights). An engine hands over state dicts and its
registries (schedulers, GradScaler, registered objects) and takes them back; where the folder goes (Accelerate's
automatic `checkpoint_<i>` naming and total_limit), what it holds and how it is published are decided here.

    final = destination(config, output_dir)                        # every rank
    write_full(final, config, position, world_size, weights, optimizers, registries, rng_states)  # main process
    path = open_for_load(config, input_dir)                        # verified against its manifest
    read_weights(path, models, optimizers); step, state = read_rest(path, registries, rank, step)
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from toolkit.config import listing
from toolkit.errors import UserError
from toolkit.checkpoint.files import (CUSTOM_FILE, SCALER_NAME, STATE_NAME, custom_file, load_safe, read_state_json,
                                      restore_rng, rng_file, state_file, state_json_text, write_training_state)
from toolkit.checkpoint.folder import (MANIFEST_NAME, building, checkpoint_format, read_manifest, remove_folder,
                                       start_folder, verify_folder)
from toolkit.checkpoint.full import load_full_weights, write_full_weights

# What save_state may replace: the files a checkpoint folder holds (sharded: torch.distributed.checkpoint's).
_CHECKPOINT_FILE = re.compile(r"(model|optimizer|scheduler|sampler|dl_state_dict)(_\d+)?\.(safetensors|bin)|"
                              r"scaler\.pt|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|state\.json|"
                              r"manifest\.json|pytorch_model(_\d+)?\.bin|\.metadata|__\d+_\d+\.distcp")
_ITERATION = re.compile(r"checkpoint_(\d+)")


@dataclass
class Registries:
    """What save_state holds besides models and optimizers, in the engine's order: its prepared schedulers, its
    GradScaler (or None) and the objects registered with register_for_checkpointing (None: not read, for
    load_checkpoint, which is given none)."""

    schedulers: list
    scaler: object
    custom_objects: list | None


# -- where --------------------------------------------------------------------------------------------------
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


# -- write --------------------------------------------------------------------------------------------------
def write_full(final: Path, config, position: dict, world_size: int, weights, optimizers, registries: Registries,
               rng_states, safe_serialization: bool = True):
    """The main process: the full folder at `final`, from the whole `weights` and `optimizers` state dicts,
    the registries, every rank's `rng_states` and `position` (training_state) as state.json."""
    make_room(final, config)
    state_text = state_json_text(position)  # fails before gigabytes are written
    write_full_folder(final, state_text, position["step"], world_size, weights, optimizers, registries, rng_states,
                      safe_serialization)


def write_full_folder(final: Path, state_text: str, step: int, world_size: int, weights, optimizers,
                      registries: Registries, rng_states, safe_serialization: bool = True):
    """The full folder at `final` (built hidden, sealed, published), for save_state and save_checkpoint alike."""
    with building(final, {"checkpoint_format": "full", "step": step, "world_size": world_size}) as temp:
        write_full_weights(temp, weights, optimizers, safe_serialization)
        _write_rest(temp, state_text, registries, rng_states)


def write_consolidated(final: Path, source: Path, weights, optimizers):
    """The full folder at `final` from the sharded folder `source`: the whole `weights` and `optimizers` (in
    torch's layout), gathered in one process, and every other file of `source` (schedulers, scaler, RNG states,
    registered objects, state.json) as it was; the manifest keeps `source`'s step and world size."""
    from toolkit.checkpoint.sharded import INDEX  # torch.distributed.checkpoint: imported by who gathered them

    saved = read_manifest(source)
    about = {"checkpoint_format": "full", "step": saved.get("step"), "world_size": saved.get("world_size")}
    with building(final, about) as temp:
        write_full_weights(temp, weights, optimizers)
        for file in source.iterdir():
            if file.name not in (INDEX, MANIFEST_NAME) and file.suffix != ".distcp":
                shutil.copy2(file, temp / file.name)


def begin_sharded(final: Path, config, position: dict, world_size: int) -> tuple[str, dict]:
    """The main process, before any rank writes a shard: room for `final`, and (state.json's text, the
    manifest's facts), refused here when `position` cannot be written."""
    make_room(final, config)
    return state_json_text(position), {"checkpoint_format": "sharded", "step": position["step"],
                                       "world_size": world_size}


def write_sharded(final: Path, model_states, optimizer_states, registries: Registries, rng_states, started):
    """Every rank: its shards of `model_states` and `optimizer_states` (sharded.local_state_dicts); the main
    process, whose `started` is begin_sharded's, also the rest and the manifest, then publishes the folder."""
    from toolkit.checkpoint.sharded import save_sharded  # torch.distributed.checkpoint: ~1 s to import

    state_text, about = started or (None, None)
    save_sharded(final, model_states, optimizer_states,
                 lambda temp: _write_rest(temp, state_text, registries, rng_states), about)


def begin_beside(final: Path, config, position: dict, pid: int) -> str:
    """The main process, before Accelerate's own save_state writes into folder.build_folder(final, pid): room
    for `final`, that build folder made fresh (folder.start_folder); returns state.json's text."""
    make_room(final, config)
    state_text = state_json_text(position)  # fails before gigabytes are written
    start_folder(final, pid)
    return state_text


def finish_beside(final: Path, temp: Path, state_text: str, about: dict):
    """The main process, once Accelerate's save_state has filled `temp`: state.json, the manifest, published."""
    with building(final, about, temp=temp):
        (temp / STATE_NAME).write_text(state_text)


def _write_rest(temp: Path, state_text: str, registries: Registries, rng_states):
    write_training_state(temp, state_text, schedulers=registries.schedulers, scaler=registries.scaler,
                         rng_states=rng_states, custom_objects=registries.custom_objects)


# -- read ---------------------------------------------------------------------------------------------------
def open_for_load(config, input_dir) -> Path:
    """Where load_state reads (`input_dir`, or with automatic naming the newest project_dir/checkpoints/
    checkpoint_<i>), verified against its manifest when it has one (Accelerate's own folders have none)."""
    path = _load_source(config, input_dir)
    if (path / MANIFEST_NAME).is_file():
        verify_folder(path)
    return path


def _load_source(config, input_dir) -> Path:
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


def is_sharded(path: Path) -> bool:
    return checkpoint_format(path) == "sharded"


def read_weights(path: Path, models, optimizers, strict: bool = True, map_location="cpu"):
    """Load the folder's models and optimizers into `models` and `optimizers` (in order); a sharded folder is
    resharded to this world size (a collective where a process group exists)."""
    if is_sharded(path):
        from toolkit.checkpoint.sharded import load_shards  # torch.distributed.checkpoint: ~1 s to import

        load_shards(path, models, optimizers)
    else:
        load_full_weights(path, models, optimizers, strict=strict, map_location=map_location)


def read_rest(path: Path, registries: Registries, rank: int | None, step: int, map_location="cpu") -> tuple[int, dict]:
    """Load what every format holds besides the weights into `registries`, restore rank `rank`'s RNG streams
    (none when `rank` is None), and return (the engine step they were saved at, else `step`; state.json, {} when
    there is none). Registries whose custom_objects is None (load_checkpoint's: it holds no registered objects)
    leave the registered objects' files unread."""
    for i, scheduler in enumerate(registries.schedulers):
        scheduler.load_state_dict(load_safe(state_file(path, "scheduler", i, "bin"), map_location))
    if registries.scaler is not None and (path / SCALER_NAME).is_file():
        registries.scaler.load_state_dict(load_safe(path / SCALER_NAME, map_location))
    if registries.custom_objects is not None:
        found = _registered_files(path)
        if len(found) != len(registries.custom_objects):
            raise UserError(f"{path} holds {len(found)} registered object(s) but {len(registries.custom_objects)} "
                            f"are registered with register_for_checkpointing; register the same objects as when it "
                            f"was saved.")
        for i, obj in enumerate(registries.custom_objects):
            obj.load_state_dict(load_safe(path / custom_file(i), map_location))
    if rank is None:
        return step, read_state_json(path)
    saved = restore_rng(path, rank)
    if saved is None and (path / rng_file(0)).is_file():  # a grown world: rank 0's streams were saved at the same step
        saved = load_safe(path / rng_file(0))
    step = int(saved["step"]) if isinstance(saved, dict) and "step" in saved else step
    return step, read_state_json(path)


def check_registered_files(path: Path):
    """Refuse a folder whose registered objects' files hold code, before Accelerate's own load_state reads them
    with weights_only=False."""
    for file in _registered_files(path):
        load_safe(file)


def saved_optimizer_steps(state: dict, steps: int) -> int:
    """The optimizer steps state.json says were taken, where its `step` is one: a folder that has `micro_step`
    beside it. Older folders' `step` was the micro-step counter, and Accelerate's own have no state.json: then
    `steps`, the count as it stands."""
    return int(state["step"]) if "micro_step" in state and "step" in state else steps


# -- read without an engine ---------------------------------------------------------------------------------
def holds_registered(path: Path, count: int) -> bool:
    """Whether the folder holds `count` registered objects' files (custom_checkpoint_0 ... count-1)."""
    return count > 0 and (path / custom_file(count - 1)).is_file()


def registered_states(path: Path) -> list:
    """The registered objects' saved states, in registration order."""
    return [load_safe(file) for file in _registered_files(path)]


def _registered_files(path: Path) -> list[Path]:
    """custom_checkpoint_<i>.pkl in the folder, in registration order."""
    found = sorted((int(m[1]), p) for p in path.iterdir() if (m := CUSTOM_FILE.fullmatch(p.name)))
    return [file for _, file in found]


def saved_schedule(path: Path) -> dict | None:
    """The learning-rate schedule's state: Accelerate's scheduler.bin, else the first registered object (where
    TrainingRun registers it), else None."""
    file = next((f for f in (path / "scheduler.bin", path / custom_file(0)) if f.is_file()), None)
    return None if file is None else load_safe(file)


def model_weights(path: Path) -> dict:
    """The first model's whole state dict, from model.safetensors (or Accelerate's pytorch_model.bin) or, in the
    sharded format, gathered from every rank's shards in this one process."""
    from toolkit.checkpoint.weights import read_weights as read_file

    if is_sharded(path):
        from toolkit.checkpoint.sharded import read_whole

        models, _ = read_whole(path)
        if not models:
            raise UserError(f"Checkpoint {path} holds no model weights in its shards.")
        return models[0]
    file = path / "model.safetensors"
    if not file.is_file() and (path / "pytorch_model.bin").is_file():
        file = path / "pytorch_model.bin"
    return read_file(file)
