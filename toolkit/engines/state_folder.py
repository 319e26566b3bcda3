"""The one checkpoint folder, read and written by every engine and by a real `accelerate.Accelerator`.

Accelerate's `save_state` layout: `model.safetensors` (`model_1.safetensors`, ... for more models),
`optimizer.bin`, `scheduler.bin`, `scaler.pt`, `random_states_<rank>.pkl` (one per rank, Accelerate's
dict of python/numpy/torch/cuda RNG states and its `step`), `custom_checkpoint_<i>.pkl` (registered objects).
The toolkit adds, without changing those files: `state.json` (where training stands: step, epoch, the data
position, the world that saved it), and `manifest.json`, written last (size and sha256 of every file), and it
publishes the folder atomically: built in a hidden `.tmp-*` sibling and renamed into place. Nothing is
unpickled beyond tensors, plain containers and numpy's RNG arrays (`weights_only=True`), so a crafted
file cannot run code.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch

from toolkit.errors import UserError

try:
    import numpy as np
except ImportError:  # numpy is optional: its RNG state is then not saved
    np = None

SCALER_NAME = "scaler.pt"
STATE_NAME = "state.json"
MANIFEST_NAME = "manifest.json"
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
CUSTOM_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")


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


# -- RNG states, in Accelerate's dict -------------------------------------------------------------------
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


def _numpy_globals():
    """What a pickled numpy RNG state needs, and nothing that can run code (Accelerate allows the same)."""
    if np is None:
        return []
    core = getattr(np, "_core", None) or np.core
    names = [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode]
    return names + ([np.dtypes.UInt32DType] if hasattr(np, "dtypes") else [])


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


def save_checked(obj, path: Path):
    """torch.save, then prove the file loads without unpickling code: fail at save time, not at resume."""
    torch.save(obj, path)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            torch.load(path, weights_only=True, mmap=True)  # mmap: the tensor data is not read
    except pickle.UnpicklingError as error:
        raise UserError(f"{path.name} would hold objects other than tensors and plain containers, so it could not "
                        f"be loaded safely ({refusal_reason(error)}); keep its state_dict plain.") from error


def refusal_reason(error) -> str:
    # torch's message is a page of advice; the line naming the refused global is the news.
    match = re.search(r"WeightsUnpickler error: (.*?)\.(?:\s|$)", str(error))
    return match[1] if match else "unsupported pickle content"


# -- atomic publish and the manifest ---------------------------------------------------------------------
def start_folder(final: Path) -> Path:
    """A fresh hidden sibling of `final` to build a save in (its parent made)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    return temp


def seal(folder: Path, about: dict):
    """Write manifest.json last (size and sha256 of every file, plus `about`) and make it all durable."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST_NAME or not path.is_file():
            continue
        fsync(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    manifest = folder / MANIFEST_NAME
    manifest.write_text(json.dumps({"format": 1, **about, "files": files}, indent=2) + "\n")
    fsync(manifest)
    fsync(folder)


def publish(temp: Path, final: Path):
    """Rename the finished `temp` to `final`; an existing `final` (a re-save) is moved aside first, so a
    complete copy exists under some name at every moment."""
    aside = None
    if final.exists():
        aside = final.with_name(f".old-{final.name}-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(temp, final)
    fsync(final.parent)
    if aside is not None:
        shutil.rmtree(aside)


def remove_folder(path: Path):
    """Delete a checkpoint folder, renamed to a hidden `.old-*` name first: a crash mid-delete leaves a leftover
    that readers skip, never a half-deleted folder under a checkpoint's name."""
    aside = path.with_name(f".old-{path.name}-{os.getpid()}")
    os.rename(path, aside)
    shutil.rmtree(aside)


def verify_folder(path) -> None:
    """Raise UserError naming `path` unless every file in its manifest exists with the right size and sha256.

    >>> verify_folder("ckpt/step-00000100")
    """
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"Checkpoint {path} does not exist.")
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        raise UserError(f"Checkpoint {path} is incomplete: manifest.json is missing.")
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(name, int(meta["size"]), str(meta["sha256"])) for name, meta in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UserError(f"Checkpoint {path} is corrupt: manifest.json is unreadable ({error}).")
    for name, size, digest in entries:
        if Path(name).name != name or name in ("", ".", ".."):  # a crafted manifest must not reach outside
            raise UserError(f"Checkpoint {path} is corrupt: manifest.json names {name!r}, not a file of the checkpoint.")
        file = path / name
        if not file.is_file():
            raise UserError(f"Checkpoint {path} is corrupt: {name} is missing.")
        actual = file.stat().st_size
        if actual != size:
            raise UserError(f"Checkpoint {path} is corrupt: {name} has {actual} bytes, expected {size}.")
        if sha256(file) != digest:
            raise UserError(f"Checkpoint {path} is corrupt: {name} fails its sha256 check.")


def is_accelerate_folder(path: Path) -> bool:
    """A folder Accelerate's save_state wrote (no manifest: nothing to verify it against)."""
    return path.is_dir() and (any(RNG_FILE.fullmatch(p.name) for p in path.iterdir())
                              or (path / "optimizer.bin").is_file())


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


def write_state_json(folder: Path, state: dict):
    (folder / STATE_NAME).write_text(json.dumps(state, indent=2) + "\n")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fsync(path: Path):
    # On a folder this makes its entries (new names, renames) durable, not just file data.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
