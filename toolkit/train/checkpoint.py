"""Portable, atomic, verifiable checkpoints.

    save_checkpoint("runs/x/ckpt", step, model=model, optimizer=opt, state={"epoch": 2}, keep=3)
    state = load_checkpoint("runs/x/ckpt", model=model, optimizer=opt)  # resumes from latest

Layout (one writer per root, normally rank 0): `root/step-00000123/` is a folder in Accelerate's save_state
layout (toolkit/engines/state_folder.py): model.safetensors, optimizer.bin, scheduler.bin, scaler.pt,
random_states_<rank>.pkl, plus the toolkit's state.json and, written last, manifest.json (size and sha256 of
each file), so `accelerator.load_state(folder)` reads it; `root/latest` names the newest. A save is built in a hidden
`.tmp-*` sibling and renamed into place, so a killed writer never leaves a half-written
`step-*` folder. Loading never unpickles code: safetensors, then `weights_only=True`. A sharded
checkpoint (toolkit/train/sharded_checkpoint.py) holds each rank's shards in place of the two weight files.
"""
import shutil
import sys
from pathlib import Path

from toolkit.errors import UserError
from toolkit.engines.state_folder import RNG_FILE, load_safe, rng_file
from toolkit.models.weights import load_model
from toolkit.train.checkpoint_files import (STATE_FILES, _current_rank, _finish_save, _publish, _read_state_file,
                                            _resolve_checkpoint, _start_save, _write_contents, checkpoint_format,
                                            set_rng_state)
# The folder format's public names, importable from here as before.
from toolkit.train.checkpoint_files import (CHECKPOINT_FORMATS, gather_rng_states, latest_checkpoint,  # noqa: F401
                                            list_checkpoints, read_state, rng_state, verify_checkpoint)


_STATEFUL = ("optimizer", "scheduler", "scaler")


def save_checkpoint(root, step, *, model, optimizer=None, scheduler=None, scaler=None,
                    state=None, keep=None, rng_states=None):
    """Atomically write checkpoint `root/step-{step:08d}`, point `root/latest` at it, prune to `keep`.

    `state` is a JSON-able dict (epoch, position, config, ...); `step` is added to it. `model` is a module
    or its state dict (`accelerator.get_state_dict(model)`: the full weights of a sharded model), and
    optimizer/scheduler/scaler are objects or their state dicts. `rng_states` (gather_rng_states(), one per
    rank) lets each rank restore its own RNG streams on resume. Returns the new folder's Path.

    >>> save_checkpoint("ckpt", 100, model=net, optimizer=opt, state={"epoch": 1}, keep=3)
    PosixPath('ckpt/step-00000100')
    """
    final, temp = _start_save(root, step, keep)
    try:
        stateful = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler}
        _write_contents(temp, model, stateful, {"step": step, **(state or {})}, rng_states)
        _publish(temp, final)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    _finish_save(root, final, keep)
    return final


def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None, scaler=None,
                    map_location="cpu", restore_rng=True):
    """Verify and load a checkpoint folder (or the latest one under a root); return its state dict.

    >>> state = load_checkpoint("ckpt", model=net, optimizer=opt)
    >>> start_step = state["step"] + 1
    """
    path = _resolve_checkpoint(Path(path))
    sharded = checkpoint_format(path) == "sharded"
    if sharded:  # a collective where a process group exists: every rank loads
        from toolkit.train.sharded_checkpoint import load_sharded

        load_sharded(path, model=model, optimizer=optimizer)
    elif model is not None:
        load_model(model, path / "model.safetensors")
    for name, obj in zip(_STATEFUL, (optimizer, scheduler, scaler)):
        if obj is None or name == "optimizer" and sharded:
            continue
        file = _state_file(path, name)
        if name == "scaler" and not file.is_file():
            # A bf16 or CPU run saved no scaler: fp16 resumes with a fresh one, which calibrates its scale
            # within the first steps (an overflow skips a step and halves it).
            print(f"[toolkit] {path} has no fp16 loss scaler (saved without fp16): starting a fresh one.",
                  file=sys.stderr)
            continue
        obj.load_state_dict(load_safe(file, map_location))
    if restore_rng:
        _restore_own_rng(path)
    return _read_state_file(path)


def _state_file(path, name):
    """Accelerate's name (optimizer.bin); checkpoints written before the layout was Accelerate's used <name>.pt."""
    file = path / STATE_FILES[name]
    legacy = path / f"{name}.pt"
    return legacy if not file.is_file() and legacy.is_file() else file


def _restore_own_rng(path):
    """Restore this rank's RNG streams: its random_states_<rank>.pkl (older checkpoints: rng.pt's list)."""
    rank = _current_rank()
    try:
        if (path / rng_file(rank)).is_file():
            set_rng_state(load_safe(path / rng_file(rank)))
            return
        if (path / "rng.pt").is_file():  # written before the layout was Accelerate's
            saved = load_safe(path / "rng.pt")
            if rank < len(saved["ranks"]):
                _set_legacy_rng(saved["ranks"][rank])
                return
        elif not any(RNG_FILE.fullmatch(p.name) for p in path.iterdir()):
            return  # saved without RNG states
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as error:  # a crafted or foreign file
        raise UserError(f"Checkpoint {path} is corrupt: its RNG file does not hold RNG states ({type(error).__name__}: "
                        f"{error}); resume with a fresh --output-dir or another checkpoint.") from None
    # the world grew since the save: this rank has no saved streams and keeps its seeded ones
    print(f"[toolkit] {path} holds no RNG state for rank {rank}; it keeps its seeded RNG.", file=sys.stderr)


def _set_legacy_rng(state):
    import random

    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
