"""Weight files that move between engines: strip every wrapper (DataParallel, DDP, torch.compile) and
save/load the bare module's tensors as safetensors, so a file written under one engine loads under any.

    save_model(ddp_model, "model.safetensors")       # keys without "module." prefixes
    load_model(bare_model, "model.safetensors")      # or into a wrapped model: it is unwrapped first
"""

from __future__ import annotations

import os
import pickle
import re
import stat
import sys
from collections.abc import Mapping
from pathlib import Path

import safetensors.torch
import torch

from toolkit.config import listing
from toolkit.errors import UserError

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN_KEYS = 3


def unwrap_model(model):
    """Return the plain module inside any nesting of DataParallel, DDP and torch.compile.

    >>> net = torch.nn.Linear(2, 2)
    >>> unwrap_model(torch.nn.DataParallel(net)) is net
    True
    """
    # accelerate's extract_model_from_parallel strips torch.compile only at the outermost
    # layer, so DDP(compile(m)) would keep `_orig_mod.`; a loop handles every order.
    # torch.compile imports dynamo, so when it is not loaded nothing can be compiled and
    # we avoid paying seconds to import it here.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled = (eval_frame.OptimizedModule,) if eval_frame else ()
    parallel = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while True:
        if isinstance(model, parallel) or getattr(type(model), "is_toolkit_wrapper", False):
            model = model.module
        elif compiled and isinstance(model, compiled):
            model = model._orig_mod
        else:
            return model


def save_model(model, path):
    """Write the unwrapped model's weights (or a state dict) to `path` as safetensors, tied weights stored once.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_model(torch.nn.DataParallel(torch.nn.Linear(2, 2)), f"{folder}/net.safetensors")
    ...     sorted(safetensors.torch.load_file(f"{folder}/net.safetensors"))  # no `module.` prefix
    ['bias', 'weight']
    """
    if isinstance(model, Mapping):  # a state dict, e.g. the full one an FSDP engine gathered
        save_safetensors(one_name_per_storage(model), path)
        return
    # safetensors.save_model drops duplicate names of tied tensors, makes tensors
    # contiguous and copies them to CPU, which plain save_file would not do.
    safetensors.torch.save_model(unwrap_model(model), str(path), metadata={"format": "pt"})
    honour_umask(path)


def save_safetensors(tensors: dict, path):
    """safetensors.torch.save_file, the file then given the mode every other file gets (honour_umask)."""
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    honour_umask(path)


def honour_umask(*paths):
    """Give each file the mode open() gives a new one: 0o666 less the umask (0644 under umask 022, 0640 under
    027). safetensors 0.8 writes through a temporary file, created 0600, that it renames into place
    (safetensors#782): the weights of a checkpoint would be the one file teammates cannot read. A file of
    another owner is left as it is (chmod would fail; this process did not write it).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     save_safetensors({"w": torch.zeros(1)}, f"{folder}/w.safetensors")
    ...     open(f"{folder}/w.txt", "w").close()
    ...     os.stat(f"{folder}/w.safetensors").st_mode == os.stat(f"{folder}/w.txt").st_mode
    True
    """
    mode = 0o666 & ~_umask()
    for path in paths:
        status = os.stat(path)
        if status.st_uid == os.geteuid() and stat.S_IMODE(status.st_mode) != mode:
            os.chmod(path, mode)


def _umask() -> int:
    """This process's umask, read without changing it where Linux shows it (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def one_name_per_storage(state_dict):
    """What safetensors.save_model does for a module: tied tensors stored once (first name), contiguous, CPU."""
    kept, seen = {}, set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        storage = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and storage in seen:
            continue
        seen.add(storage)
        kept[name] = tensor.cpu().contiguous()
    return kept


def load_model(model, path, strict=True):
    """Load weights from a safetensors/torch file or a state dict into `model` (wrapped or not).

    Keys carrying `module.`/`_orig_mod.` prefixes (the state dict of a DataParallel, DDP or compiled model)
    are accepted. Returns (missing, unexpected) key lists; with strict=True both are empty or it raises; a
    tensor of another shape always raises.

    >>> net = torch.nn.Linear(2, 2)
    >>> load_model(torch.nn.DataParallel(torch.nn.Linear(2, 2)), torch.nn.DataParallel(net).state_dict())
    ([], [])
    >>> load_model(torch.nn.Linear(2, 3), net.state_dict())
    Traceback (most recent call last):
    toolkit.errors.UserError: Weights in the given state dict do not fit this model (a checkpoint from a different model?); wrong shape: weight (2, 2) vs model (3, 2), bias (2,) vs model (3,).
    """
    target = unwrap_model(model)
    expected = target.state_dict()
    weights = strip_wrapper_prefixes(read_weights(path), expected)
    missing, unexpected, reshaped = _compare_keys(expected, weights)
    if reshaped or (strict and (missing or unexpected)):
        source = "the given state dict" if isinstance(path, Mapping) else str(path)
        raise UserError(mismatch_sentence(source, missing, unexpected, reshaped))
    if _is_sharded(expected):
        # An FSDP model: each rank takes its shards of the full tensors (a collective: every rank loads).
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(target, weights, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        target.load_state_dict(weights, strict=False)
    return missing, unexpected


def _is_sharded(state_dict):
    dtensor = sys.modules.get("torch.distributed.tensor")  # not loaded: nothing can be a DTensor
    return dtensor is not None and any(isinstance(t, dtensor.DTensor) for t in state_dict.values())


def read_weights(source):
    if isinstance(source, Mapping):
        return dict(source)
    path = Path(source)
    if not path.is_file():
        raise UserError(f"Weights file {path} does not exist.")
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path, device="cpu")
    return load_pt(path, "cpu")


def strip_wrapper_prefixes(weights, expected):
    # Peel one wrapper layer at a time and stop as soon as names fit, so a model whose own
    # submodule is called `module` keeps that part of its names.
    while weights and not weights.keys() & expected.keys():
        prefix = next((p for p in _WRAPPER_PREFIXES if all(k.startswith(p) for k in weights)), None)
        if prefix is None:
            break
        weights = {k[len(prefix):]: v for k, v in weights.items()}
    return weights


def _compare_keys(expected, weights):
    # Tied weights are saved under one name only; a key counts as present when any
    # key sharing its storage is in the file (the same rule safetensors.load_model uses).
    by_storage = {}
    for key, tensor in expected.items():
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard on this rank
        if tensor.numel() and tensor.device.type != "meta":
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
            by_storage.setdefault(storage, []).append(key)
    covered = set()
    for group in by_storage.values():
        if any(k in weights for k in group):
            covered.update(group)
    missing = [k for k in expected if k not in weights and k not in covered]
    unexpected = [k for k in weights if k not in expected]
    reshaped = [
        f"{k} {tuple(weights[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in weights
        if k in expected and weights[k].shape != expected[k].shape
    ]
    return missing, unexpected, reshaped


def mismatch_sentence(source, missing, unexpected, reshaped):
    parts = []
    for label, keys in (("missing", missing), ("unexpected", unexpected), ("wrong shape", reshaped)):
        if keys:
            parts.append(f"{label}: {listing(keys, _SHOWN_KEYS)}")
    fit = f"Weights in {source} do not fit this model (a checkpoint from a different model?)"
    return f"{fit}; {'; '.join(parts)}."


def load_pt(path, map_location):
    """torch.load that refuses anything but tensors and plain containers (weights_only=True)."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; the checkpoint was saved without it.")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise UserError(
            f"Refusing to load {path}: it holds pickled objects other than tensors and plain "
            f"containers, which could run arbitrary code ({refusal_reason(error)})."
        ) from error


def refusal_reason(error):
    # torch's message is a page of advice; the line naming the refused global is the news.
    match = re.search(r"WeightsUnpickler error: (.*?)\.(?:\s|$)", str(error))
    return match[1] if match else "unsupported pickle content"


def write_weights_folder(state_dict, directory: Path, max_shard_size, safe_serialization: bool):
    """Accelerate's save_model folder: `state_dict` as model.safetensors (pytorch_model.bin without
    safe_serialization), or as shards with their index above `max_shard_size`."""
    import json

    from huggingface_hub import split_torch_state_dict_into_shards

    directory.mkdir(parents=True, exist_ok=True)
    state_dict = one_name_per_storage(state_dict)  # tied weights once, contiguous, on the CPU
    pattern = "model{suffix}.safetensors" if safe_serialization else "pytorch_model{suffix}.bin"
    split = split_torch_state_dict_into_shards(state_dict, filename_pattern=pattern, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {name: state_dict[name] for name in names}
        if safe_serialization:
            save_safetensors(shard, directory / filename)
        else:
            torch.save(shard, directory / filename)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        name = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        (directory / name).write_text(json.dumps(index, indent=2) + "\n")
