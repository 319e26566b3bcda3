"""Checkpoints as functions, for code that holds no engine (tests, `toolkit checkpoint consolidate`, scripts), and
the names a training loop needs around `accelerator.save_state` / `load_state`:

    save_checkpoint("runs/x/ckpt", step, model=model, optimizer=opt, state={"epoch": 2}, keep=3)
    state = load_checkpoint("runs/x/ckpt", model=model, optimizer=opt)  # the latest under a root, or a folder

    accelerator.save_state(checkpoint_folder(root, step))                  # every rank
    if accelerator.is_main_process:
        finish_checkpoint(root, checkpoint_folder(root, step), keep=3)     # latest pointer, pruning

A checkpoint is the folder every engine's save_state writes (toolkit/checkpoint/folder.py): Accelerate's
layout plus state.json and manifest.json, published atomically, named `root/step-00000123/` with `root/latest`
naming the newest (and, under --keep-best, `root/best` and best.json the best evaluated: mark_best, spared by the
pruning). Loading never unpickles code. The engine-layer names are listed in `__all__` and live in
toolkit/checkpoint/folder.py and files.py; sharded saves: toolkit/checkpoint/functional_sharded.py.
"""

import sys
from pathlib import Path

import torch.distributed as dist

from toolkit.errors import UserError
from toolkit.checkpoint.files import CHECKPOINT_FORMATS, SCALER_NAME, gather_rng_states, rng_state, state_json_text
from toolkit.checkpoint.folder import (best_checkpoint, check_keep, checkpoint_folder, finish_checkpoint,
                                       latest_checkpoint, list_checkpoints, mark_best, read_state, resolve_checkpoint,
                                       seal_if_unsealed)
from toolkit.checkpoint.state import Registries, read_rest, read_weights, write_full_folder
from toolkit.checkpoint.folder import verify_folder as verify_checkpoint

__all__ = ["CHECKPOINT_FORMATS", "best_checkpoint", "checkpoint_folder", "finish_checkpoint", "gather_rng_states",
           "latest_checkpoint", "list_checkpoints", "load_checkpoint", "mark_best", "read_state", "save_checkpoint",
           "check_run_state", "seal_if_unsealed",
           "verify_checkpoint"]


def save_checkpoint(root, step, *, model, optimizer=None, scheduler=None, scaler=None,
                    state=None, keep=None, rng_states=None) -> Path:
    """Atomically write checkpoint `root/step-{step:08d}` in the full format, point `root/latest` at it, prune
    to `keep`; return its Path. Call it on one process.

    `state` is a JSON-able dict (epoch, position, config, ...); `step` is added to it. `model` is a module
    or its state dict (`accelerator.get_state_dict(model)`: the full weights of a sharded model), and
    optimizer/scheduler/scaler are objects or their state dicts. `rng_states` (gather_rng_states(), one per
    rank) lets each rank restore its own RNG streams on resume.
    """
    final = checkpoint_folder(root, step)
    check_keep(keep)
    state_text = state_json_text({"step": step, **(state or {})})
    write_full_folder(final, state_text, step, _world_size(), [model], [optimizer] if optimizer is not None else [],
                      Registries([scheduler] if scheduler is not None else [], scaler, []),
                      rng_states or [rng_state(step)])
    finish_checkpoint(root, final, keep)
    return final


def load_checkpoint(path, *, model=None, optimizer=None, scheduler=None, scaler=None,
                    map_location="cpu", restore_rng=True) -> dict:
    """Verify and load a checkpoint folder (or the latest one under a root, or a folder Accelerate's save_state
    wrote), in either format; return its state.json. A sharded one is a collective where a process group exists:
    every rank loads it, resharded to this world size."""
    path = resolve_checkpoint(path)
    models, optimizers = [m for m in (model,) if m is not None], [o for o in (optimizer,) if o is not None]
    read_weights(path, models, optimizers, map_location=map_location)
    if scaler is not None and not (path / SCALER_NAME).is_file():
        # A bf16 or CPU run saved no scaler: fp16 resumes with a fresh one, which calibrates its scale
        # within the first steps (an overflow skips a step and halves it).
        print(f"[toolkit] {path} has no fp16 loss scaler (saved without fp16): starting a fresh one.",
              file=sys.stderr)
    registries = Registries([scheduler] if scheduler is not None else [], scaler, None)
    rank = (dist.get_rank() if _distributed() else 0) if restore_rng else None
    return read_rest(path, registries, rank, 0, map_location)[1]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


# What a resume reads from state.json: key -> (type, what it must be).
STATE_KEYS = {"step": (int, "a whole number"), "epoch": (int, "a whole number"),
              "samples_in_epoch": (int, "a whole number"), "config": (dict, "an object")}


def check_run_state(state: dict, path) -> dict:
    """`state` (a checkpoint's state.json) if it holds what a resume reads; else one sentence naming the file
    and the key, instead of a KeyError half-way through restoring."""
    file = Path(path) / "state.json"
    file = file if file.is_file() else f"the state.json of the latest checkpoint under {path}"
    fix = "resume from another checkpoint or start in a fresh --output-dir."
    for key, (kind, what) in STATE_KEYS.items():
        if key not in state:
            raise UserError(f"{file} has no {key!r}, which a resume needs; {fix}")
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool) or kind is int and value < 0:
            raise UserError(f"{file} holds {key!r} = {value!r}, not {what}; {fix}")
    if not isinstance(state["config"].get("model"), str):
        raise UserError(f"{file} names no model in 'config' (it holds {state['config'].get('model')!r}); {fix}")
    return state
