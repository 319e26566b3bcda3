"""A real `accelerate.Accelerator`: every call goes to it, and the engine adds what the toolkit's contract needs.

- Machines without CUDA: launched with several processes, Accelerate 1.16 starts N processes that each believe
  they are alone (a MULTI_GPU profile falls back to `NO`) or a single process (MULTI_CPU without mpirun).
  `cpu=True` whenever no GPU is visible makes the first a real gloo group; the factory refuses the second.
- The data order is a function of (seed, epoch), as on every engine: a seedable sampler by default.
- `timeout` becomes an InitProcessGroupKwargs; after a torchrun restart the group forms in the attempt's own
  key space (`_join_restarted_group`), since env:// would read the killed attempt's gloo addresses.
- The toolkit's jsonl and csv trackers are registered with Accelerate's tracking, and logged tensors become
  numbers (Accelerate's trackio tracker drops a tensor).
- save_state and load_state are Accelerate's own, published atomically with state.json and manifest.json and
  verified against it; save and save_model give their safetensors files the umask's mode.
- Steps a GradScaler skips, or that had no backward, are counted (`skipped_steps`) instead of raising, and
  the optimizer steps are counted (`optimizer_steps`: a checkpoint's step), as on every engine.
- end_training releases the DDP wrappers' hold on the destroyed group; main_process_first ends the other
  processes when the main one fails; `toolkit parity` observes prepare and backward.
- Accelerate's per-step probe for `lomo_optim` is cached (`_cache_lomo_probe`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import random
import sys
import types
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed

from toolkit.launch.parallelism import to_accelerate
from toolkit.engines import collectives
from toolkit.engines.base import TorchEngine, cpu_requested
from toolkit.engines.group import DEFAULT_TIMEOUT_S, attempt_store, nccl_error_handling, release_ddp_wrappers
from toolkit.engines.accelerate_state import load_state_verified, save_state_atomically
from toolkit.engines.prepared import has_gradients
from toolkit.checkpoint.files import check_checkpoint_format
from toolkit.checkpoint.state import Registries
from toolkit.engines.trackers import tensors_to_numbers
from toolkit.checkpoint.weights import honour_umask
from toolkit.engines.observers import EngineObservers
from toolkit.engines.tracking import for_accelerate
from toolkit.errors import UserError


def _cache_lomo_probe():
    """Accelerate 1.16's optimizer step asks twice per step whether the `lomo_optim` package is installed,
    and each answer scans sys.path (importlib's find_spec): 0.28 ms a step, 5% of a small model's CPU step
    (benchmarks/engine_overhead.py). Installed packages do not change while a run trains, so the answer is
    cached where accelerate's modules look it up."""
    import accelerate.accelerator
    import accelerate.optimizer

    for module in (accelerate.optimizer, accelerate.accelerator):
        probe = getattr(module, "is_lomo_available", None)
        if probe is not None and not hasattr(probe, "cache_info"):
            module.is_lomo_available = functools.cache(probe)


def _count_steps(optimizer, engine):
    """Wrap an AcceleratedOptimizer's step: count the optimizer steps (the first prepared optimizer's synced
    steps, `optimizer_steps`); with a GradScaler and no backward since the last step (--skip-nonfinite),
    scaler.step would raise "No inf checks were recorded": skip it and count it, and count the steps the scaler
    skips on overflow."""
    step = optimizer.step

    def guarded(_self, *args, **kwargs):
        if not engine.accelerator.sync_gradients:
            return step(*args, **kwargs)
        first = engine.accelerator._optimizers[:1]
        engine.optimizer_steps += bool(first) and first[0] is optimizer
        if optimizer.scaler is not None and not has_gradients(optimizer.optimizer):
            optimizer._is_overflow = True  # what step_was_skipped reports
            engine.skipped_steps += 1
            return None
        result = step(*args, **kwargs)
        engine.skipped_steps += bool(optimizer.step_was_skipped)
        return result

    optimizer.step = types.MethodType(guarded, optimizer)  # a bound method: accelerate reads step.__func__


def _join_restarted_group(env, timeout: float | None, cpu: bool):
    """After a torchrun restart, form the process group in this attempt's own key space (group.attempt_store)
    before Accelerate would through env://, where a restarted group can read the killed attempt's gloo addresses
    and wait for them in init_process_group forever. Accelerate uses a group that exists."""
    if not env.restart_count or not env.agent_store or env.world_size == 1 or env.master_port is None or dist.is_initialized():
        return
    wait = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if timeout is None else timeout)
    dist.init_process_group("gloo" if cpu else "nccl", store=attempt_store(env, env.master_addr, env.master_port, wait),
                            rank=env.rank, world_size=env.world_size, timeout=wait)


class AccelerateEngine:
    """Every call goes to the Accelerator (`engine.accelerator`); anything not listed here is forwarded."""

    name = "accelerate"

    def __init__(self, env, *, timeout: float | None = None, checkpoint_format: str | None = "full", **kwargs):
        self.env = env
        self.checkpoint_format = check_checkpoint_format(checkpoint_format or "full")  # save_state's: "full" or "sharded"
        self.seed = 0
        if "cpu" not in kwargs and cpu_requested(env):  # no CUDA, or a CPU profile on a GPU host; cpu= given wins
            kwargs["cpu"] = True
        elif not kwargs.get("cpu") and torch.cuda.is_available():
            nccl_error_handling()
        if kwargs.get("parallelism_config") is not None:  # the toolkit's, as Accelerate's own (on GPUs: on CPU the
            kwargs["parallelism_config"] = to_accelerate(kwargs["parallelism_config"])  # fsdp engine runs it)
        if kwargs.get("mixed_precision") == "fp16" and (kwargs.get("cpu") or not torch.cuda.is_available()):
            raise UserError("fp16 mixed precision needs a CUDA device; use bf16 (or no) on CPU.")
        # Seeded sampling makes the data order a function of (seed, epoch), the same as the other engines:
        # set_seed's seed, else torch's initial seed when the loader is prepared.
        kwargs.setdefault("dataloader_config", DataLoaderConfiguration(use_seedable_sampler=True))
        if timeout is not None:
            handlers = list(kwargs.pop("kwargs_handlers", None) or [])
            handlers.append(InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=timeout)))
            kwargs["kwargs_handlers"] = handlers
        if kwargs.get("log_with"):  # jsonl and csv are the toolkit's: registered with Accelerate as its trackers
            logging_dir = getattr(kwargs.get("project_config"), "logging_dir", None) or kwargs.get("project_dir")
            kwargs["log_with"] = for_accelerate(kwargs["log_with"], logging_dir)
        _cache_lomo_probe()
        self._given_group = dist.is_initialized()  # Ray Train's, or the caller's: it outlives this engine
        _join_restarted_group(env, timeout, kwargs.get("cpu") or not torch.cuda.is_available())
        try:
            self.accelerator = Accelerator(**kwargs)
        except (ValueError, TypeError) as error:
            raise UserError(f"accelerate refused the settings: {error}") from None
        self._observers = EngineObservers(self)  # `toolkit parity`'s recorder, when it runs
        self._wrapped = []  # weak references to the DDP modules accelerate made

    def __getattr__(self, name):
        # Only reached for names not defined here: the whole Accelerator API stays available.
        return getattr(self.__dict__["accelerator"], name)

    # Settable Accelerator properties: without these, assignment would land on the engine, not on Accelerate.
    gradient_accumulation_steps = property(
        lambda self: self.accelerator.gradient_accumulation_steps,
        lambda self, value: setattr(self.accelerator, "gradient_accumulation_steps", value),
    )
    sync_gradients = property(
        lambda self: self.accelerator.sync_gradients,
        lambda self, value: setattr(self.accelerator, "sync_gradients", value),
    )
    step = property(  # accumulate()'s micro-step counter
        lambda self: self.accelerator.step,
        lambda self, value: setattr(self.accelerator, "step", value),
    )

    skipped_steps = 0  # optimizer steps not applied (fp16 overflow, or no backward at all)
    optimizer_steps = 0  # the first prepared optimizer's synced steps: a checkpoint's "step"
    threads = None  # a toolkit.launch.env.Threads: build_accelerator sets torch's thread count and says it here

    def prepare(self, *objects, **kwargs):
        prepared = self.accelerator.prepare(*objects, **kwargs)
        for obj in prepared if isinstance(prepared, tuple) else (prepared,):
            if hasattr(obj, "step_was_skipped"):  # an AcceleratedOptimizer
                _count_steps(obj, self)
            if isinstance(obj, DistributedDataParallel):
                self._wrapped.append(weakref.ref(obj))
        self._observers.prepared(prepared if len(objects) != 1 else (prepared,))
        return prepared

    def backward(self, loss, **kwargs):
        self._observers.backward(loss)
        self.accelerator.backward(loss, **kwargs)

    forward_backward = TorchEngine.forward_backward

    @property
    def data_parallel_size(self) -> int:
        config = self.accelerator.parallelism_config
        return self.num_processes if config is None else config.data_parallel_size

    @property
    def data_parallel_index(self) -> int:  # Accelerate's loaders' own: the tp (and cp) ranks of one group agree
        config = self.accelerator.parallelism_config
        return self.process_index if config is None else self.process_index // config.non_data_parallel_size

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None):
        self.accelerator.init_trackers(project_name, config=config, init_kwargs=init_kwargs or {})

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        # Tensors as numbers: Accelerate's trackio tracker drops a tensor value without a word.
        self.accelerator.log(tensors_to_numbers(values), step=step, log_kwargs=log_kwargs or {})

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Accelerate's own save_state, published atomically with the toolkit's state.json and manifest.json."""
        return save_state_atomically(self, output_dir, safe_serialization, **save_model_func_kwargs)

    def _registries(self) -> Registries:
        """What the Accelerator's save_state holds besides models and optimizers, for the sharded format."""
        accelerator = self.accelerator
        return Registries(accelerator._schedulers, accelerator.scaler, accelerator._custom_objects)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        """Accelerate's own save_model, its safetensors files then given the umask's mode (honour_umask)."""
        self.accelerator.save_model(model, save_directory, max_shard_size=max_shard_size,
                                    safe_serialization=safe_serialization)
        if self._writes_files():
            honour_umask(*Path(save_directory).glob("*.safetensors"))

    def save(self, obj, f, safe_serialization: bool = False):
        """Accelerate's own save, a safetensors file then given the umask's mode (honour_umask)."""
        self.accelerator.save(obj, f, safe_serialization=safe_serialization)
        if safe_serialization and self._writes_files():
            honour_umask(f)

    def _writes_files(self) -> bool:
        """Whether Accelerate's save and save_model write in this process (the main one, or each node's)."""
        if self.accelerator.project_configuration.save_on_each_node:
            return self.accelerator.is_local_main_process
        return self.accelerator.is_main_process

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        """Accelerate's own load_state, after checking the folder against its manifest when it has one."""
        return load_state_verified(self, input_dir, load_kwargs, **load_model_func_kwargs)

    def free_memory(self, *objects):
        """Accelerate's own free_memory; the optimizer steps count from 0 again, as its micro-steps do."""
        self.optimizer_steps = 0
        return self.accelerator.free_memory(*objects)

    clear = free_memory

    def end_training(self):
        if self._given_group:  # Accelerate's end_training would destroy a group it did not make
            for tracker in self.accelerator.trackers:
                tracker.finish()
        else:
            self.accelerator.end_training()  # destroys the process group
        release_ddp_wrappers(self._wrapped)

    def main_process_first(self):
        """Accelerate's order, but a failure on the main process ends the others instead of breaking their barrier."""
        return collectives.main_process_first(self)

    def gathered_parameters(self, model):
        """The model's full parameters until exit where Accelerate sharded it with FSDP2; a no-op otherwise."""
        if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded: skip importing FSDP
            return contextlib.nullcontext()
        from toolkit.engines.fsdp import full_parameters

        return full_parameters(model)

    def set_seed(self, seed: int, device_specific: bool = True):
        """Seed every RNG (plus the rank when device_specific) and the samplers' data order."""
        self.seed = int(seed)
        self.accelerator.dataloader_config.data_seed = self.seed
        set_seed(self.seed, device_specific=device_specific)
        random.seed(self.seed + (self.accelerator.process_index if device_specific else 0))
