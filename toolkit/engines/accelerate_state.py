"""save_state/load_state under the accelerate engine. In the full format Accelerate writes and reads its own
files, and the toolkit adds what its folders have everywhere: a hidden build folder renamed into place,
state.json and manifest.json, and verification before loading. In the sharded format (`checkpoint_format =
"sharded"`) the toolkit writes and reads the folder from the Accelerator's registries, as the other engines
do (toolkit/engines/checkpointing.py). The layout is the one in toolkit/checkpoint/folder.py.
"""

from __future__ import annotations

import os

import torch

from toolkit.engines.checkpointing import save_sharded_state
from toolkit.engines.collectives import all_ranks
from toolkit.checkpoint.files import check_checkpoint_format, gather_rng_states, read_state_json, training_state
from toolkit.checkpoint.folder import build_folder
from toolkit.checkpoint.state import (begin_beside, check_registered_files, destination,
                                      finish_beside, is_sharded, open_for_load, read_rest, read_weights,
                                      saved_optimizer_steps)


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
    temp = build_folder(final, pid)
    state, state_text = None, None
    with all_ranks(engine):
        if engine.is_main_process:
            state = _position(engine)
            state_text = begin_beside(final, config, state, pid)
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        accelerator.save_state(str(temp), safe_serialization=safe_serialization, **save_model_func_kwargs)
    finally:
        config.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()
    with all_ranks(engine):
        if engine.is_main_process:
            finish_beside(final, temp, state_text, {"checkpoint_format": "full", "step": state["step"],
                                                    "world_size": accelerator.num_processes})
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
    path = open_for_load(accelerator.project_configuration, input_dir)
    check_registered_files(path)  # Accelerate loads these with weights_only=False
    result = None
    if is_sharded(path):
        for hook in accelerator._load_model_state_pre_hook.values():
            hook(accelerator._models, str(path))
        read_weights(path, accelerator._models, accelerator._optimizers)
        accelerator.step, state = read_rest(path, engine._registries(), accelerator.process_index, accelerator.step)
    else:
        result = accelerator.load_state(str(path), load_kwargs=load_kwargs, **load_model_func_kwargs)
        state = read_state_json(path)
    engine.optimizer_steps = saved_optimizer_steps(state, engine.optimizer_steps)
    for loader, position in zip(accelerator._dataloaders, state.get("dataloaders", [])):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(int(position.get("epoch", 0)))
    return result
