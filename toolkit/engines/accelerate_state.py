"""save_state/load_state under the accelerate engine. In the full format Accelerate writes and reads its own
files, and the toolkit adds what its folders have everywhere: a hidden build folder renamed into place,
state.json and manifest.json, and verification before loading. In the sharded format (`checkpoint_format =
"sharded"`) the toolkit writes and reads the folder from the Accelerator's registries, as the other engines
do (toolkit/engines/checkpointing.py). The layout is the one in toolkit/checkpoint/folder.py.
"""

from __future__ import annotations

import os
import shutil

import torch

from toolkit.engines.checkpointing import (destination, load_source, load_training_state, make_room,
                                           save_sharded_state, saved_optimizer_steps)
from toolkit.engines.collectives import all_ranks
from toolkit.checkpoint.files import (CUSTOM_FILE, STATE_NAME, gather_rng_states, load_safe, read_state_json,
                                         state_json_text, training_state)
from toolkit.checkpoint.folder import (MANIFEST_NAME, building, check_checkpoint_format, checkpoint_format,
                                          remove_leftovers, verify_folder)


def save_state_atomically(engine, output_dir, safe_serialization, **save_model_func_kwargs) -> str:
    accelerator = engine.accelerator
    config = accelerator.project_configuration
    final = destination(config, output_dir)
    if check_checkpoint_format(engine.checkpoint_format) == "sharded":
        save_sharded_state(engine, final, gather_rng_states(accelerator.step),
                           accelerator._save_model_state_pre_hook.values(), lambda: _position(engine))
        config.iteration += 1
        return str(final)
    # One build folder for every rank (each writes its own random_states_<rank>.pkl there): rank 0's pid names it.
    pid = int(engine.gather(torch.tensor([os.getpid()], device=engine.device))[0])
    temp = final.with_name(f".tmp-{final.name}-{pid}")
    state, state_text = None, None
    with all_ranks(engine):
        if engine.is_main_process:
            make_room(final, config)
            state = _position(engine)
            state_text = state_json_text(state)  # fails before gigabytes are written
            final.parent.mkdir(parents=True, exist_ok=True)
            remove_leftovers(final.parent)  # build folders of writers that died, as start_folder does
            shutil.rmtree(temp, ignore_errors=True)
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        accelerator.save_state(str(temp), safe_serialization=safe_serialization, **save_model_func_kwargs)
    finally:
        config.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()
    with all_ranks(engine):
        if engine.is_main_process:
            about = {"checkpoint_format": "full", "step": state["step"], "world_size": accelerator.num_processes}
            with building(final, about, temp=temp):
                (temp / STATE_NAME).write_text(state_text)
    return str(final)


def _position(engine) -> dict:
    """state.json of the Accelerator's state; its loaders' positions are their epochs (Accelerate's iteration)."""
    accelerator = engine.accelerator
    return training_state(engine=engine.name, step=engine.optimizer_steps, micro_step=accelerator.step,
                          iteration=accelerator.save_iteration,
                          world_size=accelerator.num_processes, accumulation=accelerator.gradient_accumulation_steps,
                          loaders=[{"epoch": getattr(dl, "iteration", 0)} for dl in accelerator._dataloaders],
                          registered=accelerator._custom_objects)


def load_state_verified(engine, input_dir, load_kwargs, **load_model_func_kwargs):
    accelerator = engine.accelerator
    path = load_source(accelerator.project_configuration, input_dir)
    if (path / MANIFEST_NAME).is_file():
        verify_folder(path)
    for name in (p.name for p in path.iterdir()):  # Accelerate loads these with weights_only=False
        if CUSTOM_FILE.fullmatch(name):
            load_safe(path / name)
    result = None
    if checkpoint_format(path) == "sharded":
        for hook in accelerator._load_model_state_pre_hook.values():
            hook(accelerator._models, str(path))
        from toolkit.checkpoint.sharded import load_shards  # torch.distributed.checkpoint: ~1 s to import

        load_shards(path, accelerator._models, accelerator._optimizers)
        accelerator.step = load_training_state(engine, path, accelerator.step)
    else:
        result = accelerator.load_state(str(path), load_kwargs=load_kwargs, **load_model_func_kwargs)
    state = read_state_json(path)
    engine.optimizer_steps = saved_optimizer_steps(state, engine.optimizer_steps)
    for loader, position in zip(accelerator._dataloaders, state.get("dataloaders", [])):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(int(position.get("epoch", 0)))
    return result
