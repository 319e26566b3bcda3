"""The full checkpoint format: each model's whole weights in `model.safetensors` (`model_<i>.safetensors` for
more models; the bare model's names), each optimizer's whole state in `optimizer.bin` (torch's layout, keyed by
parameter index), as Accelerate's save_state writes them, so a real Accelerator and every engine read them at
any world size. The rest of the folder: toolkit/checkpoint/files.py; the sharded format beside this one:
toolkit/checkpoint/sharded.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.checkpoint.files import indexed, load_safe, save_checked, state_file
from toolkit.checkpoint.weights import load_model, save_model


def write_full_weights(folder: Path, weights, optimizer_states=(), safe_serialization: bool = True):
    """Write each model (a module or its full state dict) and each optimizer's full state dict into `folder`;
    `safe_serialization=False` writes Accelerate's pytorch_model.bin instead of safetensors."""
    for i, state in enumerate(weights):
        if safe_serialization:
            save_model(state, folder / indexed("model", i, "safetensors"))
        else:
            torch.save(dict(state), folder / indexed("pytorch_model", i, "bin"))
    for i, state in enumerate(optimizer_states):
        save_checked(state if isinstance(state, dict) else state.state_dict(), folder / indexed("optimizer", i, "bin"))


def load_full_weights(path: Path, models=(), optimizers=(), strict: bool = True, map_location="cpu"):
    """Load a full-format folder's weights into `models` and its optimizer states into `optimizers` (in
    order); a model's weights from model.safetensors, else Accelerate's pytorch_model.bin."""
    for i, model in enumerate(models):
        file = path / indexed("model", i, "safetensors")
        if not file.is_file() and (path / indexed("pytorch_model", i, "bin")).is_file():
            file = path / indexed("pytorch_model", i, "bin")  # read with weights_only too
        load_model(model, file, strict=strict)
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(load_safe(state_file(path, "optimizer", i, "bin"), map_location))
