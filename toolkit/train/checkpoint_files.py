"""The checkpoint folder format under checkpoint.py and sharded_checkpoint.py: Accelerate's save_state layout
(toolkit/engines/state_folder.py) named `step-N/` under a root, with a `latest` pointer, pruning and the
leftovers of killed writers; a save is built in a hidden `.tmp-*` sibling and renamed into place.
"""
import json
import os
import re
import shutil
import sys
from pathlib import Path

from toolkit.errors import UserError
from toolkit.engines.state_folder import (fsync as _fsync, indexed, is_accelerate_folder, remove_folder, rng_file,
                                          rng_state, save_checked as _save_pt, seal, verify_folder as verify_checkpoint)
# Imported from here by checkpoint.py and sharded_checkpoint.py.
from toolkit.engines.state_folder import publish as _publish, set_rng_state  # noqa: F401
from toolkit.models.weights import save_model


_CHECKPOINT_NAME = re.compile(r"step-(\d+)")

_LEFTOVER_NAME = re.compile(r"\.(?:tmp|old)-step-\d+-(\d+)")

CHECKPOINT_FORMATS = ("full", "sharded")
# Accelerate's name of each stateful object's file (optimizer.bin, scheduler.bin, scaler.pt).
STATE_FILES = {"optimizer": "optimizer.bin", "scheduler": "scheduler.bin", "scaler": "scaler.pt"}


def gather_rng_states():
    """Every rank's rng_state(), in rank order (a collective: call it on every rank before rank 0 saves).

    >>> states = gather_rng_states(); len(states) == max(1, torch.distributed.get_world_size())
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [rng_state()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states


def _current_rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size():
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _start_save(root, step, keep):
    """(final folder, its fresh hidden temp sibling) of a save; `root` made and its dead writers' leftovers removed."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep is not None and keep < 1:
        raise UserError(f"keep must be at least 1 checkpoint, got {keep}.")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step-{step:08d}"
    temp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    return final, temp


def _finish_save(root, final, keep):
    _write_pointer(Path(root), final.name)
    if keep is not None:
        _prune(Path(root), keep, final)


def _write_contents(folder, model, stateful, state, rng_states=None, checkpoint_format="full"):
    state_json = json.dumps(state, indent=2) + "\n"  # fails before gigabytes are written
    if checkpoint_format == "full":  # sharded: every rank already wrote its shards into `folder`
        save_model(model, folder / indexed("model", 0, "safetensors"))
    for name, obj in stateful.items():
        if obj is not None:
            _save_pt(obj if isinstance(obj, dict) else obj.state_dict(), folder / STATE_FILES[name])
    for rank, rng in enumerate(rng_states or [rng_state(state["step"])]):
        _save_pt(rng, folder / rng_file(rank))
    (folder / "state.json").write_text(state_json)
    # Written last: a folder whose manifest is missing or disagrees was torn or damaged.
    seal(folder, {"checkpoint_format": checkpoint_format, "step": state["step"], "world_size": _world_size()})


def _write_pointer(root, name):
    temp = root / "latest.tmp"
    with open(temp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, root / "latest")
    _fsync(root)


def _prune(root, keep, newest):
    others = [p for p in list_checkpoints(root) if p != newest]
    for old in others[: max(0, len(others) - (keep - 1))]:
        remove_folder(old)


def _remove_leftovers(root):
    for path in root.iterdir():
        match = _LEFTOVER_NAME.fullmatch(path.name)
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


def list_checkpoints(root):
    """Return complete checkpoint folders under `root` (those with a manifest), oldest step first.

    >>> [p.name for p in list_checkpoints("ckpt")]
    ['step-00000100', 'step-00000200']
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _CHECKPOINT_NAME.fullmatch(path.name)
        if match and (path / "manifest.json").is_file():
            found.append((int(match[1]), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root):
    """Return the checkpoint `root/latest` names if it verifies, else the newest one that does, else None.

    Each corrupt checkpoint skipped is reported in one line on stderr.

    >>> latest_checkpoint("ckpt")
    PosixPath('ckpt/step-00000200')
    """
    root = Path(root)
    pointed = _read_pointer(root)
    newest_first = [p for p in reversed(list_checkpoints(root)) if p != pointed]
    for path in ([pointed] if pointed else []) + newest_first:
        try:
            verify_checkpoint(path)
            return path
        except UserError as error:
            print(f"warning: skipping {path}: {error}", file=sys.stderr)
    return None


def _read_pointer(root):
    try:
        name = (root / "latest").read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):  # a folder or unreadable bytes: warned about below, then ignored
        name = ""
    if not _CHECKPOINT_NAME.fullmatch(name):
        print(f"warning: ignoring {root / 'latest'}: it does not name a checkpoint", file=sys.stderr)
        return None
    return root / name


def _read_state_file(path):
    if not (path / "state.json").exists() and is_accelerate_folder(path):
        return {}  # Accelerate's own save_state keeps no training position
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"Checkpoint {path} is corrupt: state.json is unreadable ({type(error).__name__}).") from None
    if not isinstance(state, dict):
        raise UserError(f"Checkpoint {path} is corrupt: state.json holds a {type(state).__name__}, not an object.")
    return state


def checkpoint_format(path) -> str:
    """How a verified checkpoint folder holds its weights: "full" (model.safetensors and optimizer.pt, any
    checkpoint written before the manifest named it) or "sharded" (torch.distributed.checkpoint's files).

    >>> checkpoint_format("runs/cifar/checkpoints/step-00000012")
    'sharded'
    """
    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():  # Accelerate's own save_state folder: the full format, without a manifest
        return "full"
    kind = json.loads(manifest.read_text()).get("checkpoint_format", "full")
    if kind not in CHECKPOINT_FORMATS:
        raise UserError(f"Checkpoint {path} is corrupt: its manifest names checkpoint format {kind!r}, "
                        f"not one of {', '.join(CHECKPOINT_FORMATS)}.")
    return kind


def read_state(path) -> dict:
    """The state dict of a checkpoint folder (or of the latest one under a root), verified, without loading
    any weights: check what it holds before loading it into a model.

    >>> read_state("runs/cifar/checkpoints")["config"]["model"]
    'resnet18'
    """
    return _read_state_file(_resolve_checkpoint(Path(path)))


def _resolve_checkpoint(path):
    if not path.exists():
        raise UserError(f"Checkpoint path {path} does not exist.")
    if (path / "manifest.json").exists() or _CHECKPOINT_NAME.fullmatch(path.name):
        verify_checkpoint(path)
        return path
    if is_accelerate_folder(path):  # Accelerate's own save_state wrote it: no manifest to verify it against
        return path
    latest = latest_checkpoint(path)  # already verified
    if latest is None:
        raise UserError(f"No complete checkpoint found in {path}.")
    return latest
