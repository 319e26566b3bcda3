"""The machinery the plain-PyTorch engines share.

An engine is `accelerate.Accelerator`'s public API, with the same names and meanings, declared as the
`AcceleratorAPI` protocol in engines/api.py. `AccelerateEngine` hands every call to a real Accelerator; `SingleEngine`,
`DataParallelEngine`, `RawDDPEngine` and `FSDPEngine` build on `TorchEngine` below, side by side (ddp and fsdp
share engines/group.py's world of ranks), and differ only in how they form the world, wrap a model and talk to
other ranks. Where an engine has nothing to do (a barrier with one process), the method is a no-op, so scripts
never ask which engine they are on. Checkpoints (engines/checkpointing.py), process-level calls
(engines/processes.py) and trackers (engines/tracking.py) are mixed in from their own modules.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import random

import torch
from torch.utils.data import DataLoader

from toolkit.errors import UserError
from toolkit.launch.env import LaunchEnv
from toolkit.engines.accelerate_settings import AccelerateSettingsMixin, release_accelerate_state
from toolkit.engines.checkpointing import CheckpointingMixin, ProjectConfiguration
from toolkit.engines.observers import EngineObservers
from toolkit.engines.processes import ProcessesMixin
from toolkit.checkpoint.files import check_checkpoint_format
from toolkit.engines.tracking import TrackingMixin, check_trackers
from toolkit.engines.prepared import (PreparedDataLoader, PreparedOptimizer, PreparedScheduler, has_gradients,
                                      map_tensors)
from toolkit.checkpoint.weights import unwrap_model
from toolkit.engines.compiling import compile_model, compile_settings, compiled_around, uncompiled

MIXED_PRECISION = ("no", "fp16", "bf16")


def cpu_requested(env: LaunchEnv, cpu: bool = False) -> bool:
    """True when this process must train on the CPU: asked in code, by the profile (`env.use_cpu`: `use_cpu`,
    MULTI_CPU), or no CUDA. A GPU on the host does not override the profile."""
    return cpu or env.use_cpu or not torch.cuda.is_available()


def amp_dtype(mixed_precision: str):
    """The autocast dtype of a mixed-precision setting (None for "no")."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)


def _autocast_forward(forward, device_type, dtype):
    """Run `forward` under autocast and hand back float32 outputs, as Accelerate's prepared model does."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            out = forward(*args, **kwargs)
        return map_tensors(lambda t: t.float() if t.is_floating_point() else t, out)

    return wrapped


class TorchEngine(AccelerateSettingsMixin, CheckpointingMixin, ProcessesMixin, TrackingMixin):
    """Shared body of the plain-PyTorch engines. Each engine is one class over it (with shared parts mixed in
    before it: engines/group.py's world of ranks), sets `name`, and may override these hooks, each once:
    the world: `_select_device`, `process_index`, `local_process_index`, `num_processes`, `distributed_type`,
    `is_fsdp2`, `wait_for_everyone`, `end_training`; a mesh's: `data_parallel_size`, `data_parallel_index`,
    `data_parallel_rank`, `data_parallel_shard_rank`, `tensor_parallel_rank`; the collectives: `_all_gather`,
    `_all_reduce`, `_gather_objects`; a model: `prepare_model`, `_wrap_model`, `_no_sync`, `_trigger_sync`,
    `gathered_parameters`, `get_state_dict`, `clip_grad_norm_`, `forward_backward`; the rest of prepare: `prepare`, `_prepare_one`. tests/test_layers.py
    checks the list against the engines."""

    name = "torch"
    threads = None  # a toolkit.launch.env.Threads: build_accelerator sets torch's thread count and says it here

    def __init__(self, env: LaunchEnv, *, mixed_precision: str | None = None, gradient_accumulation_steps: int = 1,
                 split_batches: bool = False, step_scheduler_with_optimizer: bool = True, cpu: bool = False,
                 timeout: float | None = None,  # seconds a collective waits; only engines with peers use it
                 checkpoint_format: str | None = "full",  # save_state's: "full", or "sharded" (each rank its own shards)
                 device_placement: bool = True, dataloader_config=None, log_with=None, project_dir=None,
                 project_config=None, gradient_accumulation_plugin=None, kwargs_handlers=None, rng_types=None,
                 dynamo_backend=None, dynamo_plugin=None, **accelerate_only):
        self._refuse_accelerate_only(accelerate_only)
        # Compiled in prepare, as Accelerate does (engines/compiling.py): asked in code, or by the profile.
        self.compile_settings = compile_settings(dynamo_backend, dynamo_plugin, env.accelerate_dynamo)
        mixed_precision = (mixed_precision or env.mixed_precision or "no").lower()
        if mixed_precision not in MIXED_PRECISION:
            raise UserError(f"mixed_precision must be one of {', '.join(MIXED_PRECISION)}, not {mixed_precision!r}.")
        plugin = gradient_accumulation_plugin
        steps = int(plugin.num_steps if plugin is not None else gradient_accumulation_steps)
        if steps < 1:
            raise UserError(f"gradient_accumulation_steps must be at least 1, not {steps}.")
        self.env = env
        self.checkpoint_format = check_checkpoint_format(checkpoint_format or "full")
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = steps
        self.sync_with_dataloader = getattr(plugin, "sync_with_dataloader", True)
        self.sync_each_batch = getattr(plugin, "sync_each_batch", False)
        self.dataloader_config = dataloader_config
        self.split_batches = bool(getattr(dataloader_config, "split_batches", split_batches))
        self.data_seed = getattr(dataloader_config, "data_seed", None)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.device_placement = device_placement
        self.use_cpu = cpu_requested(env, cpu)
        self._read_handlers(kwargs_handlers or [], timeout)
        self.seed = None  # set_seed's; None: the data order follows torch's initial seed, as Accelerate's sampler
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.step = 0  # accumulate() calls since the last optimizer step boundary (Accelerate's counter)
        self.skipped_steps = 0  # optimizer steps not applied: fp16 overflow, or no backward at all
        self.optimizer_steps = 0  # the first prepared optimizer's synced steps: a checkpoint's "step"
        self.flag_tensor = None
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._custom_objects = []
        # OrderedDicts as Accelerate keeps them: torch's RemovableHandle holds a weak reference to its registry.
        self._save_state_pre_hooks, self._load_state_pre_hooks = collections.OrderedDict(), collections.OrderedDict()
        self._active_loader: PreparedDataLoader | None = None
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and project_config is not None and project_config.project_dir is None:
            self.project_configuration.project_dir = project_dir  # Accelerate's rule: the config's own wins
        # Checked on every rank (an unknown name, a missing package or folder stops all of them); built at
        # init_trackers on the main process only.
        self.log_with, self.trackers = check_trackers(log_with, self.logging_dir), []
        self.device = self._select_device()
        if mixed_precision == "fp16" and self.device.type != "cuda":
            raise UserError("fp16 mixed precision needs a CUDA device; use bf16 (or no) on CPU.")
        self.scaler = torch.amp.GradScaler("cuda", **self._scaler_kwargs) if mixed_precision == "fp16" else None
        self._observers = EngineObservers(self)  # `toolkit parity`'s recorder, when it runs

    # -- world ---------------------------------------------------------------------------------------
    def _select_device(self) -> torch.device:
        return torch.device("cpu") if self.use_cpu else torch.device("cuda", 0)

    process_index = property(lambda self: 0)
    local_process_index = property(lambda self: 0)
    num_processes = property(lambda self: 1)
    # Not Accelerate's as such (its ParallelismConfig has data_parallel_size): the processes that read different
    # data, and this one's place among them. Every process but under a tensor-parallel mesh, whose tp ranks read
    # the same batch; the prepared loaders and the recipes' global-batch plan count these.
    data_parallel_size = property(lambda self: self.num_processes)
    data_parallel_index = property(lambda self: self.process_index)
    is_main_process = property(lambda self: self.process_index == 0)
    is_local_main_process = property(lambda self: self.local_process_index == 0)
    distributed_type = property(lambda self: "NO")  # Accelerate's DistributedType values (a str enum)
    native_amp = property(lambda self: self.mixed_precision != "no")
    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow): the learning rate should not change."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    def wait_for_everyone(self):
        pass

    def end_training(self):
        self._finish_trackers()
        release_accelerate_state(self)

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

    def data_order_seed(self) -> int:
        """The seed of every prepared loader's shuffle, the same on every rank: the dataloader_config's
        data_seed, else set_seed's, else rank 0's torch initial seed (what Accelerate's seedable sampler takes)."""
        if self.data_seed is not None:
            return int(self.data_seed)
        if self.seed is not None:
            return self.seed
        return int(self.gather(torch.tensor([torch.initial_seed() % 2**62], device=self.device))[0])

    # -- prepare -------------------------------------------------------------------------------------
    def prepare(self, *objects, device_placement=None):
        """Prepare models, optimizers, data loaders and schedulers, in any order; returns them in order."""
        prepared = [self._prepare_one(obj) for obj in objects]
        self._observers.prepared(prepared)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _prepare_one(self, obj):
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj)
        if isinstance(obj, DataLoader):
            return self.prepare_data_loader(obj)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            return self.prepare_scheduler(obj)
        return obj  # anything else (a custom loader, a config) passes through untouched

    def prepare_model(self, model: torch.nn.Module, device_placement=None, evaluation_mode: bool = False):
        # Compiled inside the engine's wrapper: torch 2.14 compiles nothing of a DDP module on CPU (its forward
        # is marked not to be traced), where Accelerate compiles over it.
        model = self._wrap_model(compile_model(model.to(self.device), self.compile_settings))
        dtype = amp_dtype(self.mixed_precision)
        if dtype is not None:
            model.forward = _autocast_forward(model.forward, self.device.type, dtype)
        self._models.append(model)
        return model

    def prepare_optimizer(self, optimizer, device_placement=None):
        optimizer = optimizer if isinstance(optimizer, PreparedOptimizer) else PreparedOptimizer(optimizer, self)
        self._optimizers.append(optimizer)
        return optimizer

    def prepare_scheduler(self, scheduler):
        scheduler = PreparedScheduler(scheduler, self)
        self._schedulers.append(scheduler)
        return scheduler

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        config = self.dataloader_config
        if config is not None and (not getattr(config, "even_batches", True) or getattr(config, "dispatch_batches", None)):
            raise UserError(f"the {self.name} engine shards every loader evenly on each rank (even_batches, no "
                            f"dispatch_batches); use the accelerate engine for that dataloader_config.")
        loader = PreparedDataLoader(data_loader, self)
        self._dataloaders.append(loader)
        return loader

    def _wrap_model(self, model):
        return model

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The plain module inside every wrapper; Accelerate's default (keep_torch_compile) keeps it compiled."""
        plain = unwrap_model(model)
        return compiled_around(plain, model) if keep_torch_compile else plain

    def gathered_parameters(self, model):
        """The model's full parameters on every rank until exit: a replicated model holds them already."""
        return contextlib.nullcontext()

    def get_state_dict(self, model, unwrap: bool = True):
        """Accelerate's name: the model's full state dict on the main process (a replicated model holds it
        whole on every rank; the fsdp engine gathers its shards). Call it on every rank."""
        return self.unwrap_model(model, keep_torch_compile=False).state_dict()

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The loader's current epoch without its first `num_batches` batches (they are not even loaded):
        Accelerate's mid-epoch resume. The returned loader advances the same epoch counter."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise UserError("skip_first_batches takes a data loader returned by accelerator.prepare.")
        return dataloader.skipping(num_batches)

    # -- training step -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def accumulate(self, *models):
        """Accumulate gradients over `gradient_accumulation_steps` calls; no gradient sync on the others."""
        self._do_sync()
        with contextlib.ExitStack() as stack:
            if not self.sync_gradients:
                for model in models:
                    stack.enter_context(self._no_sync(uncompiled(model)))
            yield

    def _do_sync(self):
        if self.sync_with_dataloader and self.end_of_dataloader:
            self.step, self.sync_gradients = 0, True
            return
        self.step += 1
        self.sync_gradients = self.sync_each_batch or self.step % self.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self, model):
        with self._no_sync(uncompiled(model)):
            yield

    def _no_sync(self, model):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        """Sync gradients in the next backward even if the forward ran under no_sync (Accelerate's call)."""
        with self._trigger_sync(uncompiled(model)):
            yield

    def _trigger_sync(self, model):
        return contextlib.nullcontext()

    def backward(self, loss, **kwargs):
        self._observers.backward(loss)
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    def forward_backward(self, model, inputs, targets, loss_fn, backward_if=None):
        """One micro-batch's loss and its backward, in one call (not Accelerate's: a pipeline's step is a schedule
        of both over micro-batches, which a forward then a backward cannot express). Here exactly
        `loss = loss_fn(model(inputs), targets)`, then `backward(loss)` unless `backward_if(loss)` says False."""
        loss = loss_fn(model(inputs), targets)
        if backward_if is None or backward_if(loss):
            self.backward(loss)
        return loss

    def autocast(self, autocast_handler=None):
        dtype = amp_dtype(self.mixed_precision)
        if dtype is None:
            return contextlib.nullcontext()
        settings = autocast_handler.to_kwargs() if autocast_handler is not None else self._autocast_kwargs
        return torch.autocast(device_type=self.device.type, dtype=dtype, **settings)

    def unscale_gradients(self, optimizer=None):
        """Unscale fp16 gradients once before clipping; a no-op without a GradScaler."""
        if self.scaler is None or not self.sync_gradients:
            return
        chosen = self._optimizers if optimizer is None else [optimizer]
        for prepared in chosen:
            inner = getattr(prepared, "optimizer", prepared)
            if has_gradients(inner):  # no inf check to record without gradients
                self.scaler.unscale_(inner)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        self.unscale_gradients()
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # -- collectives ---------------------------------------------------------------------------------
    def _all_gather(self, tensor, group=None):  # gather variable-length dim-0 tensors from every rank (of `group`)
        return tensor

    def _all_reduce(self, tensor, op):
        return tensor

    def _gather_objects(self, objects: list, group=None) -> list:  # every rank's list, concatenated in rank order
        return list(objects)

    # The ranks whose samples differ, for gather_for_metrics: None, every rank; under a tensor-parallel mesh the
    # data-parallel ranks of this one's tp position (the tp ranks of a group hold the same batch).
    _data_group = None

    def gather_object(self, objects: list) -> list:
        return self._gather_objects(objects)

    def gather(self, tensor):
        return map_tensors(lambda t: self._all_gather(t if t.dim() else t.unsqueeze(0)), tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """Gather per-sample results from every rank, dropping the samples the sampler repeated as padding."""
        loader = self._active_loader
        data = input_data
        if loader is not None and loader.valid_in_batch is not None:
            size, valid = loader.valid_in_batch
            if valid < size:
                data = map_tensors(lambda t: t[:valid] if t.dim() and t.shape[0] == size else t, data)
        if use_gather_object or not _holds_tensors(data):
            return self._gather_objects(list(data) if isinstance(data, (list, tuple)) else [data], self._data_group)
        return map_tensors(lambda t: self._all_gather(t if t.dim() else t.unsqueeze(0), self._data_group), data)

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', not {reduction!r}")
        return map_tensors(lambda t: self._all_reduce(t.clone() * scale if scale != 1.0 else t.clone(), reduction),
                           tensor)


def _holds_tensors(data) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return bool(data) and all(_holds_tensors(d) for d in data)
    if isinstance(data, dict):
        return bool(data) and all(_holds_tensors(d) for d in data.values())
    return False
