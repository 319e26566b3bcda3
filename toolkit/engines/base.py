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
from torch.utils.data import DataLoader

from toolkit import errors
from toolkit.errors import UserError
from toolkit.launch.env import LaunchEnv
from toolkit.check.capture import build_recorder
from toolkit.engines.prepared import (PreparedDataLoader, PreparedOptimizer, PreparedScheduler, has_gradients,
                                      map_tensors)

MIXED_PRECISION = ("no", "fp16", "bf16")


def cpu_requested(cpu: bool = False) -> bool:
    """True when this process must train on the CPU: asked in code, by the profile (`use_cpu`, MULTI_CPU:
    the launchers set ACCELERATE_USE_CPU), or no CUDA. A GPU on the host does not override the profile."""
    import os

    flag = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on")
    return cpu or flag or not torch.cuda.is_available()


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
        from toolkit.models.weights import unwrap_model

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
