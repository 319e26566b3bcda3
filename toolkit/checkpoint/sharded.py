"""The sharded checkpoint format, through `torch.distributed.checkpoint` (DCP), for models too big to gather on
one rank: every rank writes its own shards of the models and optimizers, and a run at another world size (or
under another engine) reads back the pieces it holds.

The folder is toolkit/checkpoint/folder.py's, with DCP's files in place of model.safetensors and
optimizer.bin: `.metadata` (the index of every tensor piece) and `__R_0.distcp` (rank R's pieces), under the
keys `model` (`model_1`, ... for more models) and `optim` (`optim_1`, ...); next to them the rest of the
training state (toolkit/checkpoint/files.py). The manifest covers the shards too and says
"checkpoint_format": "sharded" and the world size. All ranks write into one hidden build folder that rank 0
renames into place once every shard is written, so a sharded save is as atomic as a full one; that folder must
be on storage all ranks see.

Nothing here unpickles code. DCP itself reads `.metadata` with pickle.load and non-tensor values (the
optimizer's param_groups) with torch.load(weights_only=False); here the index goes through an unpickler that
knows only DCP's metadata classes, and the values through weights_only loading.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import (DefaultLoadPlanner, DefaultSavePlanner,
                                                          _EmptyStateDictLoadPlanner)
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from toolkit.errors import PeerFailure, UserError
from toolkit.checkpoint.folder import building, start_folder
from toolkit.checkpoint.weights import mismatch_sentence, refusal_reason, unwrap_model

INDEX = ".metadata"  # DCP's name for the index of a checkpoint
_INDEX_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                  ("pathlib._local", "PosixPath"),  # Python 3.13's name of the same class
                  ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process():
    # DCP warns on every call without a process group that it assumes one process: here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _inner(optimizer):
    """The torch optimizer inside a prepared one (toolkit's or Accelerate's): DCP maps its parameters to names."""
    return getattr(optimizer, "optimizer", optimizer)


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def _shards(model_states, optimizer_states) -> dict:
    return {**{_key("model", i): s for i, s in enumerate(model_states)},
            **{_key("optim", i): s for i, s in enumerate(optimizer_states)}}


# -- saving -------------------------------------------------------------------------------------------------
def local_state_dicts(models, optimizers=()) -> tuple[list[dict], list[dict]]:
    """Each model's and each optimizer's state as this rank holds it (DTensor shards under FSDP), keyed by
    parameter name: what save_sharded writes. Every rank calls it (under FSDP1 it is a collective)."""
    models = [unwrap_model(model) for model in models]
    model_states = [get_model_state_dict(model) for model in models]
    optimizer_states = []
    for i, optimizer in enumerate(optimizers):
        owner = _owner(models, optimizer, i)
        state = _renamed(get_optimizer_state_dict(owner, _inner(optimizer)), getattr(owner, "checkpoint_aliases", {}))
        whole = getattr(_inner(optimizer), "whole_param_names", None)  # a pipeline stage's: every stage's names
        if whole is not None:
            state["param_groups"] = [{**g, "params": names} for g, names in zip(state["param_groups"], whole)]
        optimizer_states.append(state)
    return model_states, optimizer_states


def _renamed(optimizer_state: dict, aliases: dict) -> dict:
    """An optimizer's state under the whole model's parameter names: a pipeline stage that holds a tied weight under
    its other name (the output head's, the embedding's being on the first stage) has an alias to the whole model's."""
    if not aliases:
        return optimizer_state
    name = lambda key: aliases.get(key, key)  # noqa: E731
    return {"state": {name(k): v for k, v in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [name(k) for k in g["params"]]} for g in optimizer_state["param_groups"]]}


def _owner(models, optimizer, index):
    """The model holding the optimizer's parameters: DCP names an optimizer's state by them."""
    first = next((p for group in _inner(optimizer).param_groups for p in group["params"]), None)
    for model in models:
        if any(p is first for p in model.parameters()):
            return model
    raise UserError(f"optimizer {index} updates no parameter of a prepared model, and a sharded checkpoint names an "
                    f"optimizer's state by its model's parameters; prepare its model too, or save the full format.")


def save_sharded(final: Path, model_states, optimizer_states, finish, about: dict | None) -> Path:
    """Every rank: rank 0 makes the hidden build folder beside `final` and tells the others its name, every rank
    writes its shards of `model_states` and `optimizer_states` (local_state_dicts) into it, then rank 0 checks
    that every shard arrived, calls `finish(folder)` to write the rest, and seals the folder with `about` (rank
    0's) and publishes it as `final` (folder.building). When rank 0 cannot make the folder, the others stop
    with a quiet PeerFailure."""
    main = not _distributed() or dist.get_rank() == 0
    temp = _shared_build_folder(final, main)
    try:
        with building(final, about, temp=temp) if main else contextlib.nullcontext():
            # Replicated values (BatchNorm buffers, a ddp model) come from rank 0, as in a full checkpoint.
            with _quiet_single_process():
                index = dcp.save(_shards(model_states, optimizer_states), storage_writer=FileSystemWriter(temp),
                                 planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), no_dist=not _distributed())
            if main:
                _check_all_shards_here(temp, index)
                finish(temp)
    except CheckpointException as error:  # DCP's wrapper of each rank's failure (a disk full...)
        raise _first_cause(error) from None
    return final


def _check_all_shards_here(temp, index):
    """Every rank wrote into `temp`; on node-local storage the other nodes' shards landed elsewhere."""
    absent = sorted({info.relative_path for info in index.storage_data.values()} - {p.name for p in temp.iterdir()})
    if absent:
        raise UserError(f"{', '.join(absent)} written by other ranks did not reach {temp.parent} as rank 0 sees it: "
                        "a sharded checkpoint needs a folder on storage every rank shares (one file system across "
                        "nodes), or the full checkpoint format.")


def _shared_build_folder(final, main):
    """The build folder rank 0 made (its name carries rank 0's pid), on every rank. When rank 0 cannot make it,
    rank 0 raises the cause and the others stop quietly."""
    temp = failed = None
    if main:
        try:
            temp = start_folder(final)
        except Exception as error:
            failed = error
    if _distributed():
        told = [(str(temp), 0) if failed is None else (None, getattr(failed, "exit_code", 1))] if main else [None]
        dist.broadcast_object_list(told, src=0)
        name, code = told[0]
        if name is None and not main:
            raise PeerFailure(code, 0)
        temp = Path(name) if name else None
    if failed is not None:
        raise failed
    return temp


# -- loading ------------------------------------------------------------------------------------------------
def load_shards(path, models=(), optimizers=()):
    """Load a verified sharded folder into `models` and `optimizers` (in order), resharded to this run's world
    size: a collective where a process group exists. Weights of another model are refused before DCP reads."""
    path = Path(path)
    index = read_index(path)
    if not models:
        return
    models = [unwrap_model(model) for model in models]
    for i, model in enumerate(models):
        _check_fits(path, index, model, _key("model", i))
    model_states, optimizer_states = local_state_dicts(models, optimizers)  # the shapes and shards this rank holds
    _read_pieces(_shards(model_states, optimizer_states), path, _SafeLoadPlanner())
    for model, state in zip(models, model_states):
        set_model_state_dict(model, state)
    for i, (optimizer, state) in enumerate(zip(optimizers, optimizer_states)):
        owner = _owner(models, optimizer, i)
        back = {whole: own for own, whole in getattr(owner, "checkpoint_aliases", {}).items()}
        state = _renamed(state, back)
        if getattr(_inner(optimizer), "whole_param_names", None) is not None:  # this stage's names of each group
            mine = set(dict(owner.named_parameters()))
            state["param_groups"] = [{**g, "params": [n for n in g["params"] if n in mine]} for g in state["param_groups"]]
        set_optimizer_state_dict(owner, _inner(optimizer), state)


def _check_fits(path, index, model, key):
    """Refuse, before DCP reads a byte, weights of another model (the full format's sentence)."""
    prefix = key + "."
    saved = {k[len(prefix):]: tuple(meta.size) for k, meta in index.state_dict_metadata.items()
             if k.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}  # a DTensor's shape is the full one
    elsewhere = getattr(model, "other_stages_keys", ())  # a pipeline stage's: the keys the other stages load
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected and k not in elsewhere]
    reshaped = [f"{k} {saved[k]} vs model {expected[k]}" for k in saved if k in expected and saved[k] != expected[k]]
    if missing or unexpected or reshaped:
        raise UserError(mismatch_sentence(str(path), missing, unexpected, reshaped))


def read_whole(path) -> tuple[list[dict], list[dict]]:
    """Every model's weights and every optimizer's state (keyed by parameter name) of a sharded folder, whole, in
    one process without a process group (DCP's dcp_to_torch_save way)."""
    planner = _SafeEmptyPlanner()
    _read_pieces({}, Path(path), planner, no_dist=True)
    whole = planner.original_state_dict
    return _in_order(whole, "model"), _in_order(whole, "optim")


def _in_order(whole, kind):
    found = []
    while _key(kind, len(found)) in whole:
        found.append(whole[_key(kind, len(found))])
    return found


def _read_pieces(state_dict, path, planner, no_dist=None):
    planner.source = str(path)
    try:
        with _quiet_single_process():
            dcp.load(state_dict, storage_reader=_SafeReader(path), planner=planner,
                     no_dist=not _distributed() if no_dist is None else no_dist)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as error:
        cause = _first_cause(error)  # DCP gathers every rank's failure: the first one is the news
        if isinstance(cause, UserError):
            raise cause from None
        first_line = next((line for line in str(cause).splitlines() if line.strip()), "")
        raise UserError(f"Checkpoint {path} could not be loaded into this model and optimizer "
                        f"({type(cause).__name__}: {first_line.split('. ')[0].rstrip('.')[:200]}).") from None


def _first_cause(error):
    for failure, _trace in getattr(error, "failures", {}).values():
        return failure
    return error


def read_index(path):
    """DCP's index (`.metadata`) of a sharded checkpoint folder, unpickled knowing only DCP's metadata classes."""
    file = Path(path) / INDEX
    if not file.is_file():
        raise UserError(f"Checkpoint {path} is corrupt: its manifest says sharded but {INDEX} is missing.")
    try:
        with open(file, "rb") as f:
            return _IndexUnpickler(f, file).load()
    except UserError:
        raise
    except Exception as error:
        raise UserError(f"Checkpoint {path} is corrupt: {INDEX} is unreadable ({type(error).__name__}).") from None


class _IndexUnpickler(pickle.Unpickler):
    def __init__(self, file, name):
        super().__init__(file)
        self.name = name

    def find_class(self, module, name):
        allowed = (module == "torch.distributed.checkpoint.metadata" or (module, name) in _INDEX_GLOBALS
                   or module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UserError(f"Refusing to load {self.name}: it asks to run {module}.{name}, which a checkpoint "
                            "index never needs; nothing ran.")
        return super().find_class(module, name)


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        metadata = read_index(self.path)
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyBytes:
    """Non-tensor values (param_groups' numbers, flags and names) through torch.load(weights_only=True)."""

    source = "a sharded checkpoint"  # _read_pieces names the folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UserError(f"Refusing to load {read_item.dest_index.fqn} of {self.source}: it holds objects "
                            f"other than tensors and plain values ({refusal_reason(error)}).") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _SafeLoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _SafeEmptyPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass
