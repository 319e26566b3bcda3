"""save_state/load_state under the accelerate engine: Accelerate writes and reads its own files; the toolkit
adds what its folders have everywhere: a hidden build folder renamed into place, state.json and manifest.json,
and verification before loading. The layout is the one in toolkit/engines/state_folder.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from toolkit import errors
from toolkit.engines import state_folder as folder_format
from toolkit.engines.checkpointing import destination, make_room


def save_state_atomically(engine, output_dir, safe_serialization, **save_model_func_kwargs) -> str:
    accelerator = engine.accelerator
    config = accelerator.project_configuration
    final = destination(config, output_dir)
    # One build folder for every rank (each writes its own random_states_<rank>.pkl there): rank 0's pid names it.
    pid = int(engine.gather(torch.tensor([os.getpid()], device=engine.device))[0])
    temp = final.with_name(f".tmp-{final.name}-{pid}")
    with errors.all_ranks(engine):
        if engine.is_main_process:
            make_room(final, config)
            final.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(temp, ignore_errors=True)
    automatic, config.automatic_checkpoint_naming = config.automatic_checkpoint_naming, False
    try:
        accelerator.save_state(str(temp), safe_serialization=safe_serialization, **save_model_func_kwargs)
    finally:
        config.automatic_checkpoint_naming = automatic
    accelerator.wait_for_everyone()
    with errors.all_ranks(engine):
        if engine.is_main_process:
            try:
                state = {"step": accelerator.step, "iteration": accelerator.save_iteration, "engine": engine.name,
                         "world_size": accelerator.num_processes,
                         "gradient_accumulation_steps": accelerator.gradient_accumulation_steps,
                         "dataloaders": [{"epoch": getattr(dl, "iteration", 0)} for dl in accelerator._dataloaders]}
                folder_format.write_state_json(temp, state)
                folder_format.seal(temp, {"checkpoint_format": "full", "step": accelerator.step,
                                          "world_size": accelerator.num_processes})
                folder_format.publish(temp, final)
            except BaseException:
                shutil.rmtree(temp, ignore_errors=True)
                raise
    return str(final)


def load_state_verified(engine, input_dir, load_kwargs, **load_model_func_kwargs):
    accelerator = engine.accelerator
    path = Path(input_dir) if input_dir is not None else None
    if path is not None:
        if not path.is_dir():
            raise errors.UserError(f"load_state: {path} is not a folder; pass the folder save_state wrote.")
        if (path / folder_format.MANIFEST_NAME).is_file():
            folder_format.verify_folder(path)
        for name in (p.name for p in path.iterdir()):  # Accelerate loads these with weights_only=False
            if folder_format.CUSTOM_FILE.fullmatch(name):
                folder_format.load_safe(path / name)
    result = accelerator.load_state(None if path is None else str(path), load_kwargs=load_kwargs,
                                    **load_model_func_kwargs)
    if path is not None:
        state = folder_format.read_state_json(path)
        for loader, position in zip(accelerator._dataloaders, state.get("dataloaders", [])):
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(int(position.get("epoch", 0)))
    return result
