"""The engine contract, and the machinery the three plain-PyTorch engines share.

An engine is the part of `accelerate.Accelerator`'s API that recipes use, with the same names and
meanings. `AccelerateEngine` hands every call to a real Accelerator; `SingleEngine`, `DataParallelEngine`
and `RawDDPEngine` build on `TorchEngine` below and differ only in how they form the world, wrap a
model and talk to other ranks. Where an engine has nothing to do (a barrier with one process), the
method is a no-op, so recipes never ask which engine they are on.
"""

from __future__ import annotations

import contextlib
import functools
import random

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from toolkit import errors
from toolkit.errors import UserError
from toolkit.launch_env import LaunchEnv
from toolkit.parity_capture import build_recorder

MIXED_PRECISION = ("no", "fp16", "bf16")


def move_to(batch, device):
    """Move every tensor in a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def map_tensors(fn, data):
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, d) for d in data)
    if isinstance(data, dict):
        return {k: map_tensors(fn, v) for k, v in data.items()}
    return data


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps only when gradients are synced (the last micro-step of an accumulation), through the scaler."""

    # Deliberately no super().__init__: this is a view of an existing optimizer, as Accelerate's is.
    def __init__(self, optimizer: torch.optim.Optimizer, engine: "TorchEngine"):
        self.optimizer = optimizer
        self.engine = engine
        self.step_was_skipped = False

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True):
        if self.engine.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self.engine.sync_gradients:
            return
        scaler = self.engine.scaler
        if scaler is None:
            self.optimizer.step(closure)
            self.step_was_skipped = False
            return
        if not has_gradients(self.optimizer):
            # No backward since the last step (--skip-nonfinite skipped it on every micro-step): the scaler
            # recorded no inf checks, so scaler.step would raise. Nothing to apply: skip and count.
            self.step_was_skipped = True
            self.engine.skipped_steps += 1
            return
        scale = scaler.get_scale()
        scaler.step(self.optimizer, closure)
        scaler.update()
        self.step_was_skipped = scaler.get_scale() < scale  # the scaler backed off: inf/nan gradients
        self.engine.skipped_steps += self.step_was_skipped

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)


def has_gradients(optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def cpu_requested(cpu: bool = False) -> bool:
    """True when this process must train on the CPU: asked in code, by the profile (`use_cpu`, MULTI_CPU:
    the launchers set ACCELERATE_USE_CPU), or no CUDA. A GPU on the host does not override the profile."""
    import os

    flag = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on")
    return cpu or flag or not torch.cuda.is_available()


class PreparedScheduler:
    """Accelerate's scheduler meaning: step on optimizer steps only, `num_processes` ticks per step
    (schedules are written in single-process steps) unless `split_batches`."""

    def __init__(self, scheduler, engine: "TorchEngine"):
        self.scheduler = scheduler
        self.engine = engine

    def step(self, *args, **kwargs):
        engine = self.engine
        if not engine.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not engine.sync_gradients or any(o.step_was_skipped for o in engine._optimizers):
            return
        for _ in range(1 if engine.split_batches else engine.num_processes):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)


class PreparedDataLoader:
    """A DataLoader re-sharded with a DistributedSampler (set_epoch every epoch, automatically) that moves
    batches to the device and knows which samples of each batch are sampler padding."""

    def __init__(self, loader: DataLoader, engine: "TorchEngine"):
        self.engine = engine
        self.epoch = 0
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.sampler = None
        self.valid_in_batch = None
        if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
            self.loader = loader  # nothing to re-shard: the user's dataset decides
            return
        self.sampler = DistributedSampler(
            loader.dataset,
            num_replicas=engine.num_processes,
            rank=engine.process_index,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=engine.seed,
        )
        kwargs = dict(
            batch_size=loader.batch_size,
            sampler=self.sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
        )
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        self.loader = DataLoader(loader.dataset, **kwargs)
        # DistributedSampler pads with repeats so every rank has as many samples: count the real ones.
        n, world, rank = len(loader.dataset), engine.num_processes, engine.process_index
        self.real_samples = len(range(rank, n, world))

    def __len__(self):
        return len(self.loader)

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        if hasattr(self.dataset, "set_epoch"):  # a dataset that seeds per-epoch augmentation, as Accelerate allows
            self.dataset.set_epoch(self.epoch)
        engine, seen = self.engine, 0
        engine.end_of_dataloader = False
        iterator = iter(self.loader)
        try:
            batch = next(iterator)
        except StopIteration:
            return
        while True:
            try:  # look one batch ahead so the last batch is known before it is used
                upcoming = next(iterator)
            except StopIteration:
                upcoming = None
            size = _batch_len(batch)
            if self.sampler is not None and size is not None:
                self.valid_in_batch = (size, max(0, min(size, self.real_samples - seen)))
                seen += size
            engine.end_of_dataloader = upcoming is None
            engine._active_loader = self
            yield move_to(batch, engine.device)
            if upcoming is None:
                break
            batch = upcoming
        engine._active_loader = None
        engine.end_of_dataloader = False
        self.epoch += 1


def _batch_len(batch):
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return None


def _autocast_forward(forward, device_type, dtype):
    """Run `forward` under autocast and hand back float32 outputs, as Accelerate's prepared model does."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)

    return wrapped


class TorchEngine:
    """Shared body of the plain-PyTorch engines. Subclasses set `name` and override the hooks
    `_wrap_model`, `_no_sync`, `_all_gather`, `_all_reduce`, `wait_for_everyone`, `end_training`."""

    name = "torch"

    def __init__(
        self,
        env: LaunchEnv,
        *,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        split_batches: bool = False,
        step_scheduler_with_optimizer: bool = True,
        cpu: bool = False,
        timeout: float | None = None,  # seconds a collective waits; only engines with peers use it
    ):
        mixed_precision = (mixed_precision or env.mixed_precision or "no").lower()
        if mixed_precision not in MIXED_PRECISION:
            raise UserError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, not {mixed_precision!r}.")
        if int(gradient_accumulation_steps) < 1:
            raise UserError(f"gradient_accumulation_steps must be at least 1, not {gradient_accumulation_steps}.")
        self.env = env
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.split_batches = split_batches
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.use_cpu = cpu_requested(cpu)
        self.seed = 0
        self.sync_gradients = True
        self.end_of_dataloader = False
        self._step = 0
        self.skipped_steps = 0  # optimizer steps not applied: fp16 overflow, or no backward at all
        self._optimizers: list[PreparedOptimizer] = []
        self._active_loader: PreparedDataLoader | None = None
        self.device = self._select_device()
        if mixed_precision == "fp16" and self.device.type != "cuda":
            raise UserError("fp16 mixed precision needs a CUDA device; use bf16 (or no) on CPU.")
        self.scaler = torch.amp.GradScaler("cuda") if mixed_precision == "fp16" else None
        self._recorder = build_recorder(self)  # `toolkit parity` only; otherwise its hooks do nothing

    # -- world ---------------------------------------------------------------------------------------
    def _select_device(self) -> torch.device:
        return torch.device("cpu") if self.use_cpu else torch.device("cuda", 0)

    process_index = property(lambda self: 0)
    local_process_index = property(lambda self: 0)
    num_processes = property(lambda self: 1)
    is_main_process = property(lambda self: self.process_index == 0)
    is_local_main_process = property(lambda self: self.local_process_index == 0)

    def wait_for_everyone(self):
        pass

    def end_training(self):
        pass

    def main_process_first(self):
        """The main process runs the block first; a failure on any rank ends every rank, said once."""
        return errors.main_process_first(self)

    def print(self, *args, **kwargs):
        if self.is_local_main_process:
            print(*args, **kwargs)

    def set_seed(self, seed: int, device_specific: bool = True):
        """Seed python, numpy and torch (plus `seed + rank` when device_specific); data order uses `seed`."""
        self.seed = int(seed)
        rank_seed = self.seed + (self.process_index if device_specific else 0)
        random.seed(rank_seed)
        torch.manual_seed(rank_seed)
        try:
            import numpy

            numpy.random.seed(rank_seed % 2**32)
        except ImportError:
            pass

    # -- prepare -------------------------------------------------------------------------------------
    def prepare(self, *objects):
        """Prepare models, optimizers, data loaders and schedulers, in any order; returns them in order."""
        prepared = [self._prepare_one(obj) for obj in objects]
        self._recorder.prepared(prepared)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj):
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            optimizer = obj if isinstance(obj, PreparedOptimizer) else PreparedOptimizer(obj, self)
            self._optimizers.append(optimizer)
            return optimizer
        if isinstance(obj, DataLoader):
            return PreparedDataLoader(obj, self)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return PreparedScheduler(obj, self)
        return obj  # anything else (a custom loader, a config) passes through untouched

    def prepare_model(self, model: torch.nn.Module):
        model = self._wrap_model(model.to(self.device))
        if self.mixed_precision != "no":
            dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
            model.forward = _autocast_forward(model.forward, self.device.type, dtype)
        return model

    def _wrap_model(self, model):
        return model

    def unwrap_model(self, model):
        from toolkit.weights import unwrap_model

        return unwrap_model(model)

    def get_state_dict(self, model, unwrap: bool = True):
        """Accelerate's name: the model's full state dict on the main process (a replicated model holds it
        whole on every rank; the fsdp engine gathers its shards). Call it on every rank."""
        return (self.unwrap_model(model) if unwrap else model).state_dict()

    # -- training step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models):
        """Accumulate gradients over `gradient_accumulation_steps` calls; no gradient sync on the others."""
        if self.end_of_dataloader:
            self._step, self.sync_gradients = 0, True
        else:
            self._step += 1
            self.sync_gradients = self._step % self.gradient_accumulation_steps == 0
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients:
                for model in models:
                    stack.enter_context(self._no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model):
        with self._no_sync(model):
            yield

    def _no_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss, **kwargs):
        self._recorder.backward(loss)
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def autocast(self):
        if self.mixed_precision == "no":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.mixed_precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        if self.scaler is not None and self.sync_gradients:
            for optimizer in self._optimizers:
                if has_gradients(optimizer.optimizer):  # no inf check to record without gradients
                    self.scaler.unscale_(optimizer.optimizer)
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # -- collectives ---------------------------------------------------------------------------------
    def _all_gather(self, tensor):  # gather variable-length dim-0 tensors from every rank
        return tensor

    def _all_reduce(self, tensor, op):
        return tensor

    def gather(self, data):
        return map_tensors(lambda t: self._all_gather(t if t.dim() else t.unsqueeze(0)), data)

    def gather_for_metrics(self, data):
        """Gather per-sample results from every rank, dropping the samples the sampler repeated as padding."""
        loader = self._active_loader
        if loader is not None and loader.valid_in_batch is not None:
            size, valid = loader.valid_in_batch
            if valid < size:
                data = map_tensors(lambda t: t[:valid] if t.dim() and t.shape[0] == size else t, data)
        return self.gather(data)

    def reduce(self, data, reduction: str = "sum"):
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', not {reduction!r}")
        return map_tensors(lambda t: self._all_reduce(t.clone(), reduction), data)
