"""Sharded checkpoints as a function, for code that holds no engine: every rank writes its own shards of the
model and optimizer (torch.distributed.checkpoint), rank 0 the rest, into one `step-N` folder published as
atomically as a full one (the format: toolkit/checkpoint/sharded.py).

    save_sharded_checkpoint("runs/x/checkpoints", 12, model=model, optimizer=opt, scheduler=sched,
                            state={"epoch": 0}, keep=3)                               # on every rank
    load_checkpoint("runs/x/checkpoints/step-00000012", model=model, optimizer=opt)   # any world size
    consolidate("runs/x/checkpoints/step-00000012", "runs/x/full")    # toolkit/checkpoint/consolidate.py

An engine saves the same folder with `checkpoint_format="sharded"` and `accelerator.save_state(folder)`.
"""

from pathlib import Path

import torch.distributed as dist

from toolkit.checkpoint.files import rng_state, state_json_text
from toolkit.checkpoint.folder import check_keep, checkpoint_folder, finish_checkpoint
from toolkit.checkpoint.sharded import local_state_dicts, read_index
from toolkit.checkpoint.state import Registries, write_sharded

__all__ = ["read_index", "save_sharded_checkpoint"]


def save_sharded_checkpoint(root, step, *, model, optimizer=None, scheduler=None, scaler=None, state=None,
                            keep=None, rng_states=None) -> Path:
    """Call on every rank: each writes its shards of `model` and `optimizer`, rank 0 the rest (scheduler,
    scaler, RNG, state.json) and the manifest, then renames the folder into place, points `root/latest` at it
    and prunes to `keep`, as save_checkpoint does. Returns the folder's Path."""
    final = checkpoint_folder(root, step)
    check_keep(keep)
    state_text = state_json_text({"step": step, **(state or {})})  # refused on every rank before any shard
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    model_states, optimizer_states = local_state_dicts([model], [optimizer] if optimizer is not None else [])
    registries = Registries([scheduler] if scheduler is not None else [], scaler, [])
    write_sharded(final, model_states, optimizer_states, registries, rng_states or [rng_state(step)],
                  (state_text, {"checkpoint_format": "sharded", "step": step, "world_size": world}))
    if not distributed or dist.get_rank() == 0:
        finish_checkpoint(root, final, keep)
    return final
