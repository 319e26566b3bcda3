"""The one checkpoint folder, read and written by every engine, by a real `accelerate.Accelerator` and by the
functional API in toolkit/checkpoint/functional.py.

Accelerate's `save_state` layout: `model.safetensors` (`model_1.safetensors`, ... for more models),
`optimizer.bin`, `scheduler.bin`, `scaler.pt`, `random_states_<rank>.pkl` (one per rank, Accelerate's
dict of python/numpy/torch/cuda RNG states and its `step`), `custom_checkpoint_<i>.pkl` (registered objects).
The toolkit adds, without changing those files: `state.json` (where training stands: step, epoch, the data
position, the world that saved it), and `manifest.json`, written last (size and sha256 of every file, and the
checkpoint format: "full", or "sharded" with torch.distributed.checkpoint's files in place of the model and
optimizer files, toolkit/checkpoint/sharded.py). A folder is built in a hidden `.tmp-<name>-<pid>` sibling
and renamed into place, so a killed writer never leaves a torn folder under a checkpoint's name.

Under a checkpoints root the folders are `step-<8 digits>` (checkpoint_folder); `root/latest` names the newest
and finish_checkpoint prunes the oldest and removes what dead writers left, sparing the one `root/best` names
(mark_best, with best.json: --keep-best); latest_checkpoint skips a damaged folder with a one-line warning.
What the files hold, and how they are read safely: toolkit/checkpoint/files.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

from toolkit.errors import UserError
from toolkit.checkpoint.files import CHECKPOINT_FORMATS, RNG_FILE, read_state_json
from toolkit.checkpoint.weights import honour_umask

MANIFEST_NAME = "manifest.json"
STEP_FOLDER = re.compile(r"step-(\d+)")
# The build folders (.tmp-*) and folders set aside (.old-*) of a writer, named with its pid.
_LEFTOVER = re.compile(r"\.(?:tmp|old)-(?:step-\d+|checkpoint_\d+)-(\d+)")


def checkpoint_folder(root, step: int) -> Path:
    """The folder of the checkpoint of optimizer step `step` under a checkpoints root.

    >>> checkpoint_folder("runs/x/checkpoints", 12).as_posix()
    'runs/x/checkpoints/step-00000012'
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return Path(root) / f"step-{step:08d}"


# -- building a folder: atomic publish and the manifest ---------------------------------------------------
@contextlib.contextmanager
def building(final: Path, about: dict, temp: Path | None = None):
    """Every checkpoint folder is written in this block: it yields a hidden build folder beside `final` for the
    files, and when the block ends seals it (manifest.json, with `about`) and publishes it as `final`. On any
    error the build folder is removed and `final` is as it was. `temp`: a build folder other ranks have written
    into already (start_folder's, made by the main process)."""
    temp = start_folder(final) if temp is None else temp
    try:
        yield temp
        seal(temp, about)
        publish(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def build_folder(final: Path, pid: int | None = None) -> Path:
    """The hidden sibling of `final` that process `pid` (this one by default) builds a save in."""
    return final.with_name(f".tmp-{final.name}-{os.getpid() if pid is None else pid}")


def start_folder(final: Path, pid: int | None = None) -> Path:
    """A fresh build_folder of `final` (its parent made; leftovers of writers that died beside it removed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(final.parent)
    temp = build_folder(final, pid)
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    return temp


def seal(folder: Path, about: dict):
    """Write manifest.json last (size and sha256 of every file, plus `about`) and make it all durable. Every
    file gets the mode the umask gives, whoever wrote it (Accelerate's safetensors writes are 0600)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.name == MANIFEST_NAME or not path.is_file():
            continue
        honour_umask(path)
        fsync(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256(path)}
    manifest = folder / MANIFEST_NAME
    manifest.write_text(json.dumps({"format": 1, **about, "files": files}, indent=2) + "\n")
    fsync(manifest)
    fsync(folder)


def seal_if_unsealed(folder, step: int, world_size: int):
    """Seal a step folder that Accelerate's own `save_state` wrote (it writes no manifest): the size and sha256
    of each of its files, so that --resume and `latest` verify it as they verify the toolkit's. Call it on the
    main process once every rank has written its files; a folder an engine sealed is left as it is."""
    folder = Path(folder)
    if not (folder / MANIFEST_NAME).is_file():
        seal(folder, {"checkpoint_format": "full", "step": step, "world_size": world_size})


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


def remove_leftovers(root: Path):
    """Remove the build and set-aside folders under `root` whose writer is no longer running."""
    for path in root.iterdir():
        match = _LEFTOVER.fullmatch(path.name)
        if match and path.is_dir() and not _writer_alive(int(match[1])):
            shutil.rmtree(path, ignore_errors=True)


def _writer_alive(pid):
    if pid == os.getpid():
        return False  # saves in one process run one after another: ours are leftovers
    if os.name != "posix":
        return True  # os.kill(pid, 0) would terminate the process on Windows
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    return True


# -- a checkpoints root: step-N folders, the latest and best pointers, pruning -----------------------------
def finish_checkpoint(root, folder, keep: int | None = None):
    """On the main process once `folder` (a step-N folder under `root`) is published: point `root/latest` at
    it, delete the oldest checkpoints beyond `keep` (None keeps all; never the one `root/best` names) and what
    dead writers left."""
    check_keep(keep)
    root, folder = Path(root), Path(folder)
    _write_pointer(root, folder.name)
    prune_checkpoints(root, folder, keep)
    remove_leftovers(root)


def mark_best(root, folder, about: dict, keep: int | None = None):
    """On the main process: `folder` (a published step-N folder under `root`) holds the best evaluation so far.
    `root/best` names it and `root/best.json` says why (`about` and the folder's name); the checkpoint best named
    before is deleted unless it is among the last `keep`."""
    root, folder = Path(root), Path(folder)
    _write_pointer(root, folder.name, "best")
    temp = root / "best.json.tmp"
    temp.write_text(json.dumps({**about, "folder": folder.name}, indent=2) + "\n")
    os.replace(temp, root / "best.json")
    fsync(root)
    newest = _read_pointer(root)
    if newest is not None:
        prune_checkpoints(root, newest, keep)


def prune_checkpoints(root, newest: Path, keep: int | None):
    """Delete the oldest checkpoints but `newest` beyond `keep` in all, sparing the one `root/best` names."""
    if keep is None:
        return
    best = _read_pointer(root, "best")
    spared = {newest.name, best.name if best is not None else None}
    others = [p for p in list_checkpoints(root) if p.name not in spared]
    for old in others[: max(0, len(others) - (keep - 1))]:
        remove_folder(old)


def best_checkpoint(root) -> Path | None:
    """The checkpoint folder `root/best` names (--keep-best), if it is there."""
    best = _read_pointer(Path(root), "best")
    return best if best is not None and best.is_dir() else None


def check_keep(keep: int | None):
    if keep is not None and keep < 1:
        raise UserError(f"keep must be at least 1 checkpoint, got {keep}.")


def _write_pointer(root, name, pointer="latest"):
    temp = root / f"{pointer}.tmp"
    with open(temp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, root / pointer)
    fsync(root)


def list_checkpoints(root) -> list[Path]:
    """The complete checkpoint folders under `root` (those with a manifest), oldest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_FOLDER.fullmatch(path.name)
        if match and (path / MANIFEST_NAME).is_file():
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root) -> Path | None:
    """The newest checkpoint under `root` that verifies, else None; each damaged one skipped is reported in one
    line on stderr, the folder `root/latest` names among them. The newest, not the pointer's: a folder is complete once
    published (its manifest written last, then renamed into place), and a run killed between publishing a
    folder and moving the pointer must resume from that folder, not the one before."""
    root = Path(root)
    candidates = set(list_checkpoints(root))
    pointed = _read_pointer(root)
    if pointed is not None and pointed.is_dir():  # named but without its manifest: verified, so it is reported
        candidates.add(pointed)
    for path in sorted(candidates, key=lambda p: int(STEP_FOLDER.fullmatch(p.name)[1]), reverse=True):
        try:
            verify_folder(path)
            return path
        except UserError as error:
            print(f"warning: skipping {path}: {error}", file=sys.stderr)
    return None


def _read_pointer(root, pointer="latest"):
    try:
        name = (root / pointer).read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):  # a folder or unreadable bytes: warned about below, then ignored
        name = ""
    if not STEP_FOLDER.fullmatch(name):
        print(f"warning: ignoring {root / pointer}: it does not name a checkpoint", file=sys.stderr)
        return None
    return root / name


# -- reading a folder --------------------------------------------------------------------------------------
def verify_folder(path) -> None:
    """Raise UserError naming `path` unless every file in its manifest exists with the right size and sha256."""
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


def read_manifest(path) -> dict:
    """The manifest of checkpoint folder `path` (its format, step, world size and files), {} where it has none."""
    manifest = Path(path) / MANIFEST_NAME
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def checkpoint_format(path) -> str:
    """How a verified checkpoint folder holds its weights: "full" (model.safetensors and optimizer.bin, any
    folder without a manifest, any written before the manifest named it) or "sharded" (DCP's files)."""
    kind = read_manifest(path).get("checkpoint_format", "full")  # no manifest: Accelerate's own, full
    if kind not in CHECKPOINT_FORMATS:
        raise UserError(f"Checkpoint {path} is corrupt: its manifest names checkpoint format {kind!r}, "
                        f"not one of {', '.join(CHECKPOINT_FORMATS)}.")
    return kind


def resolve_checkpoint(path) -> Path:
    """The verified folder `path` names: a checkpoint folder itself, a folder Accelerate's save_state wrote, or
    a checkpoints root (its latest checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"Checkpoint path {path} does not exist.")
    if (path / MANIFEST_NAME).exists() or STEP_FOLDER.fullmatch(path.name):
        verify_folder(path)
        return path
    if is_accelerate_folder(path):  # Accelerate's own save_state wrote it: no manifest to verify it against
        return path
    latest = latest_checkpoint(path)  # already verified
    if latest is None:
        raise UserError(f"No complete checkpoint found in {path}.")
    return latest


def read_state(path) -> dict:
    """The state.json of a checkpoint folder (or of the latest one under a root), verified, without loading
    any weights: check what it holds before loading it into a model ({} for a folder Accelerate wrote)."""
    return read_state_json(resolve_checkpoint(path))


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
