"""The files of a checkpoint folder (toolkit/checkpoint/folder.py) besides the weights: their names, the
training state every format holds (schedulers, the GradScaler, each rank's RNG streams, registered objects,
state.json), and reading them without unpickling code: only tensors, plain containers and numpy's RNG arrays
(`weights_only=True`), so a crafted file cannot run anything.
"""

from __future__ import annotations

import codecs
import json
import pickle
import random
import re
import sys
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.checkpoint.weights import refusal_reason

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG state is then not saved
    np = None

SCALER_NAME = "scaler.pt"
STATE_NAME = "state.json"
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
CUSTOM_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")


CHECKPOINT_FORMATS = ("full", "sharded")


def check_checkpoint_format(kind: str) -> str:
    """`kind` if it is a checkpoint format save_state can write, else one sentence.

    >>> check_checkpoint_format("sharded")
    'sharded'
    """
    if kind not in CHECKPOINT_FORMATS:
        raise UserError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, not {kind!r}.")
    return kind


def indexed(stem: str, index: int, suffix: str) -> str:
    """Accelerate's file name of the index-th object of a kind.

    >>> indexed("optimizer", 0, "bin"), indexed("model", 1, "safetensors")
    ('optimizer.bin', 'model_1.safetensors')
    """
    return f"{stem}.{suffix}" if index == 0 else f"{stem}_{index}.{suffix}"


def rng_file(rank: int) -> str:
    return f"random_states_{rank}.pkl"


def custom_file(index: int) -> str:
    return f"custom_checkpoint_{index}.pkl"


def state_file(path: Path, stem: str, index: int, suffix: str) -> Path:
    """The index-th `stem` file in `path`: Accelerate's name, or `<stem>.pt` where only that exists (written
    before the layout was Accelerate's)."""
    file = path / indexed(stem, index, suffix)
    legacy = path / f"{stem}.pt"
    return legacy if index == 0 and not file.is_file() and legacy.is_file() else file


# -- writing ------------------------------------------------------------------------------------------------
def state_json_text(state: dict) -> str:
    """state.json's text, made before any file is written: a value JSON cannot hold fails the save first."""
    try:
        return json.dumps(state, indent=2) + "\n"
    except (TypeError, ValueError) as error:
        raise UserError(f"state.json cannot hold the training state ({error}); keep its values to numbers, "
                        f"strings, lists and dicts.") from None


def training_state(*, engine: str, step: int, micro_step: int, iteration: int, world_size: int, accumulation: int,
                   loaders: list, registered) -> dict:
    """state.json, for every engine: where the engine stands (`step`: the optimizer steps taken; `micro_step`:
    accumulate()'s counter, Accelerate's `Accelerator.step`; `iteration`: its save count), which world saved it,
    each prepared loader's position, then what registered objects add (a training loop's own `step` is an
    optimizer step too)."""
    state = {"step": step, "micro_step": micro_step, "iteration": iteration, "engine": engine,
             "world_size": world_size, "gradient_accumulation_steps": accumulation, "dataloaders": loaders}
    return with_registered_state(state, registered)


def with_registered_state(state: dict, objects) -> dict:
    """`state` updated with the dict each registered object's `state_json()` returns, where it has that method
    (its keys win): how a training loop puts its position (step, epoch, ...) into state.json."""
    merged = dict(state)
    for obj in objects:
        if callable(getattr(obj, "state_json", None)):
            extra = obj.state_json()
            if not isinstance(extra, dict):
                raise UserError(f"{type(obj).__name__}.state_json() returned a {type(extra).__name__}; it must return "
                                f"a dict of the keys to add to state.json.")
            merged.update(extra)
    return merged


def write_training_state(folder: Path, state_text: str, *, schedulers=(), scaler=None, rng_states=(),
                         custom_objects=()):
    """Write what every format holds besides the weights: each scheduler's state (an object or its state dict),
    the scaler's, one RNG file per rank (`rng_states` in rank order), each registered object's state_dict and
    state.json (`state_text`, from state_json_text)."""
    for i, scheduler in enumerate(schedulers):
        save_checked(_state_dict(scheduler), folder / indexed("scheduler", i, "bin"))
    if scaler is not None:
        save_checked(_state_dict(scaler), folder / SCALER_NAME)
    for rank, state in enumerate(rng_states):
        save_checked(state, folder / rng_file(rank))
    for i, obj in enumerate(custom_objects):
        save_checked(obj.state_dict(), folder / custom_file(i))
    (folder / STATE_NAME).write_text(state_text)


def _state_dict(obj):
    return obj if isinstance(obj, dict) else obj.state_dict()


def save_checked(obj, path: Path):
    """torch.save, then prove the file loads without unpickling code: fail at save time, not at resume."""
    torch.save(obj, path)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            torch.load(path, weights_only=True, mmap=True)  # mmap: the tensor data is not read
    except pickle.UnpicklingError as error:
        raise UserError(f"{path.name} would hold objects other than tensors and plain containers, so it could not "
                        f"be loaded safely ({refusal_reason(error)}); keep its state_dict plain.") from error


# -- reading ------------------------------------------------------------------------------------------------
def load_safe(path: Path, map_location="cpu"):
    """torch.load refusing everything but tensors, plain containers and numpy arrays (weights_only=True)."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; the checkpoint was saved without it.")
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UserError(f"Refusing to load {path}: it holds pickled objects other than tensors and plain "
                        f"containers, which could run arbitrary code ({refusal_reason(error)}).") from error


def _numpy_globals():
    """What a pickled numpy RNG state needs, and nothing that can run code (Accelerate allows the same)."""
    if np is None:
        return []
    core = getattr(np, "_core", None) or np.core
    names = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    return names + ([np.dtypes.UInt32DType] if hasattr(np, "dtypes") else [])


def read_state_json(path: Path) -> dict:
    """The toolkit's state.json of a folder, {} for a folder Accelerate wrote without one."""
    file = path / STATE_NAME
    if not file.exists():
        return {}
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"Checkpoint {path} is corrupt: state.json is unreadable ({type(error).__name__}).") from None
    if not isinstance(state, dict):
        raise UserError(f"Checkpoint {path} is corrupt: state.json holds a {type(state).__name__}, not an object.")
    return state


# -- RNG streams, in Accelerate's dict ------------------------------------------------------------------------
def rng_state(step: int = 0) -> dict:
    """This process's RNG streams in the dict Accelerate's `save_state` writes to random_states_<rank>.pkl.

    >>> s = rng_state(); a = torch.rand(1); set_rng_state(s); assert torch.equal(a, torch.rand(1))
    """
    state = {"step": int(step), "random_state": random.getstate(), "torch_manual_seed": torch.get_rng_state()}
    if np is not None:
        state["numpy_random_seed"] = np.random.get_state()
    if torch.cuda.is_available():
        state["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    """Restore what rng_state() (or Accelerate) captured; parts for absent libraries or devices are skipped.

    >>> set_rng_state(rng_state())
    """
    version, internal, gauss = state["random_state"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_manual_seed"].cpu())
    if np is not None and "numpy_random_seed" in state:
        np.random.set_state(state["numpy_random_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in state:
        # A resume on fewer GPUs restores the devices that exist.
        for device, device_state in enumerate(state["torch_cuda_manual_seed"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state.cpu(), device)


def gather_rng_states(step: int = 0) -> list[dict]:
    """Every rank's rng_state(step), in rank order: a collective where a process group exists (every rank calls
    it before rank 0 saves).

    >>> len(gather_rng_states())
    1
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rng_state(step)]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(step))
    return states


def restore_rng(path: Path, rank: int) -> dict | None:
    """Restore rank `rank`'s RNG streams from `path` and return what its file held; None when the folder holds
    none for it (saved without RNG states, or by a smaller world: then this rank keeps its seeded streams, said
    once for all such ranks, by the first of them). Checkpoints written before the layout was Accelerate's hold
    every rank's in rng.pt."""
    try:
        if (path / rng_file(rank)).is_file():
            saved = load_safe(path / rng_file(rank))
            set_rng_state(saved)
            return saved
        if (path / "rng.pt").is_file():
            legacy = load_safe(path / "rng.pt")["ranks"]
            saved_ranks = len(legacy)
            if rank < saved_ranks:
                _set_legacy_rng(legacy[rank])
                return {}
        else:
            saved_ranks = sum(1 for p in path.iterdir() if RNG_FILE.fullmatch(p.name))
            if not saved_ranks:
                return None  # saved without RNG states
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:  # a crafted or foreign file
        raise UserError(f"Checkpoint {path} is corrupt: its RNG file does not hold RNG states ({type(error).__name__}: "
                        f"{error}); resume from another checkpoint.") from None
    if rank == saved_ranks:
        print(f"[toolkit] {path} holds RNG states for {saved_ranks} rank(s); rank {rank} and above keep their seeded "
              "RNG.", file=sys.stderr)
    return None


def _set_legacy_rng(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
