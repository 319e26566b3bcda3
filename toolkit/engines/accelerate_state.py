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
from toolkit.engines.checkpointing import _ITERATION, _refuse_foreign_files


def _final_dir(accelerator, output_dir) -> Path:
    config = accelerator.project_configuration
    if not config.automatic_checkpoint_naming:
        if output_dir is None:
            raise errors.UserError("save_state needs an output_dir (or ProjectConfiguration(automatic_checkpoint_naming=True)).")
        return Path(output_dir)
    return Path(accelerator.project_dir) / "checkpoints" / f"checkpoint_{accelerator.save_iteration}"


def _prune(root: Path, limit):
    if limit is None or not root.is_dir():
        return
    folders = sorted((int(m[1]), p) for p in root.iterdir() if (m := _ITERATION.fullmatch(p.name)))
    for _, path in folders[: max(0, len(folders) + 1 - limit)]:
        aside = path.with_name(f".old-{path.name}-{os.getpid()}")
        os.rename(path, aside)
        shutil.rmtree(aside)


def save_state_atomically(engine, output_dir, safe_serialization, **save_model_func_kwargs) -> str:
    accelerator = engine.accelerator
    config = accelerator.project_configuration
    final = _final_dir(accelerator, output_dir)
    # One build folder for every rank (each writes its own random_states_<rank>.pkl there): rank 0's pid names it.
    pid = int(engine.gather(torch.tensor([os.getpid()], device=engine.device))[0])
    temp = final.with_name(f".tmp-{final.name}-{pid}")
    with errors.all_ranks(engine):
        if engine.is_main_process:
            if final.exists() and config.automatic_checkpoint_naming:
                raise errors.UserError(f"checkpoint folder {final} already exists; set accelerator.project_configuration"
                                       f".iteration to the iteration to continue from.")
            if config.automatic_checkpoint_naming:
                _prune(final.parent, config.total_limit)
            _refuse_foreign_files(final)
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
                (temp / folder_format.STATE_NAME).write_text(_json(state))
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


def _json(state) -> str:
    import json

    return json.dumps(state, indent=2) + "\n"
