"""Sharded checkpoints through `torch.distributed.checkpoint` (DCP), for models too big to gather on one rank:
every rank writes its own shards of the model and the optimizer, and a run at another world size (or under
another engine) reads back the pieces it holds.

    save_sharded_checkpoint("runs/x/checkpoints", 12, model=model, optimizer=opt, scheduler=sched,
                            state={"epoch": 0}, keep=3)                       # on every rank
    load_checkpoint("runs/x/checkpoints/step-00000012", model=model, optimizer=opt)   # any world size
    consolidate("runs/x/checkpoints/step-00000012", "runs/x/full")    # toolkit/train/consolidate.py

The step folder is checkpoint.py's, with DCP's files in place of model.safetensors and optimizer.bin:
`.metadata` (the index of every tensor piece) and `__R_0.distcp` (rank R's pieces), next to scheduler.bin,
random_states_<rank>.pkl and state.json; manifest.json covers the shards too and says "checkpoint_format": "sharded" and the
world size. All ranks write into one hidden temp folder that rank 0 renames into place once every shard is
written, so a sharded save is as atomic as a full one. That folder must be on storage all ranks see.

Nothing here unpickles code. DCP itself reads `.metadata` with pickle.load and non-tensor values (the
optimizer's param_groups) with torch.load(weights_only=False); here the index goes through an unpickler that
knows only DCP's metadata classes, and the values through weights_only loading.
"""

import contextlib
import io
import pickle
import shutil
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
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from toolkit.train.checkpoint_files import _finish_save, _publish, _start_save, _write_contents
from toolkit.errors import PeerFailure, UserError
from toolkit.models.weights import mismatch_sentence, refusal_reason, unwrap_model

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


def save_sharded_checkpoint(root, step, *, model, optimizer=None, scheduler=None, scaler=None, state=None,
                            keep=None, rng_states=None):
    """Call on every rank: each writes its shards of `model` and `optimizer` (DCP), rank 0 the rest (scheduler,
    scaler, RNG, state.json) and the manifest, then renames the folder into place as save_checkpoint does.

    >>> save_sharded_checkpoint("ckpt", 100, model=net, optimizer=opt, state={"epoch": 1}, keep=3)
    PosixPath('ckpt/step-00000100')
    """
    main = not _distributed() or dist.get_rank() == 0
    final, temp = _shared_temp_folder(root, step, keep, main)
    try:
        model = unwrap_model(model)
        model_state, optimizer_state = get_state_dict(model, _inner(optimizer) if optimizer is not None else [])
        shards = {"model": model_state, **({"optim": optimizer_state} if optimizer is not None else {})}
        # Replicated values (BatchNorm buffers, a ddp model) come from rank 0, as in a full checkpoint.
        with _quiet_single_process():
            index = dcp.save(shards, storage_writer=FileSystemWriter(temp),
                             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True), no_dist=not _distributed())
        if not main:
            return Path(root) / f"step-{step:08d}"
        _check_all_shards_here(temp, index)
        _write_contents(temp, None, {"scheduler": scheduler, "scaler": scaler},
                             {"step": step, **(state or {})}, rng_states, checkpoint_format="sharded")
        _publish(temp, final)
    except BaseException as error:
        if main:
            shutil.rmtree(temp, ignore_errors=True)
        if isinstance(error, CheckpointException):  # DCP's wrapper of each rank's failure (a disk full...)
            raise _first_cause(error) from None
        raise
    _finish_save(root, final, keep)
    return final


def _check_all_shards_here(temp, index):
    """Every rank wrote into `temp`; on node-local storage the other nodes' shards landed elsewhere."""
    absent = sorted({info.relative_path for info in index.storage_data.values()} - {p.name for p in temp.iterdir()})
    if absent:
        raise UserError(f"{', '.join(absent)} written by other ranks did not reach {temp.parent} as rank 0 sees it: "
                        "sharded checkpoints need an --output-dir on storage every rank shares (one file system "
                        "across nodes), or use --checkpoint-format full.")


def _shared_temp_folder(root, step, keep, main):
    """(final folder, temp folder) on rank 0, (None, rank 0's temp folder) elsewhere: every rank writes into the
    one rank 0 made (its name carries rank 0's pid). When rank 0 cannot make it, the others stop quietly."""
    final = temp = failed = None
    if main:
        try:
            final, temp = _start_save(root, step, keep)
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
    return final, temp


def load_sharded(path, *, model=None, optimizer=None):
    """Load a verified sharded checkpoint folder into `model` and its `optimizer` (optional; without a model
    nothing is loaded), resharded to this run's world size: a collective where a process group exists."""
    path = Path(path)
    index = read_index(path)
    if model is None:
        return
    model = unwrap_model(model)
    _check_fits(path, index, model)
    optimizers = [_inner(optimizer)] if optimizer is not None else []
    model_state, optimizer_state = get_state_dict(model, optimizers)  # the shapes and shards this rank holds
    shards = {"model": model_state, **({"optim": optimizer_state} if optimizers else {})}
    read_pieces(shards, path, _SafeLoadPlanner())
    set_state_dict(model, optimizers, model_state_dict=model_state,
                   optim_state_dict=optimizer_state if optimizers else {})


def _check_fits(path, index, model):
    """Refuse, before DCP reads a byte, weights of another model (the full format's sentence)."""
    saved = {k[len("model."):]: tuple(meta.size) for k, meta in index.state_dict_metadata.items()
             if k.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}  # a DTensor's shape is the full one
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    reshaped = [f"{k} {saved[k]} vs model {expected[k]}" for k in saved if k in expected and saved[k] != expected[k]]
    if missing or unexpected or reshaped:
        raise UserError(mismatch_sentence(str(path), missing, unexpected, reshaped))


def read_pieces(state_dict, path, planner, no_dist=None):
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

    source = "a sharded checkpoint"  # read_pieces names the folder

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


class SafeEmptyPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


