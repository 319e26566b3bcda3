"""Accelerate's process-level calls for the plain-PyTorch engines: which process runs a function, splitting
and padding data across processes, a trigger any rank can pull, freeing memory and profiling. Built only on
the engine's own collectives (`gather`, `reduce`, `wait_for_everyone`), so every engine gets them unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os

import torch

from toolkit.engines import collectives
from toolkit.engines.prepared import map_tensors


class ProcessesMixin:
    """Needs from the engine: `process_index`, `local_process_index`, `num_processes`, `device`, `gather`,
    `reduce`, `wait_for_everyone`, `profile_handler`."""

    is_last_process = property(lambda self: self.process_index == self.num_processes - 1)
    use_distributed = property(lambda self: self.num_processes > 1)

    # -- which process runs ------------------------------------------------------------------------------
    def main_process_first(self):
        """The main process runs the block first; a failure on any rank ends every rank, said once."""
        return collectives.main_process_first(self)

    @contextlib.contextmanager
    def local_main_process_first(self):
        """The local main process of each node runs the block first (one download per node), then the others."""
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def on_main_process(self, function):
        return self._only_on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function):
        return self._only_on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function):
        return self._only_on(function, lambda: self.is_last_process)

    def on_process(self, function=None, process_index=None):
        if function is None:  # used as @accelerator.on_process(process_index=2)
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function=None, local_process_index=None):
        if function is None:
            return functools.partial(self.on_local_process, local_process_index=local_process_index)
        return self._only_on(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _only_on(function, chosen):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            return function(*args, **kwargs) if chosen() else None

        return wrapper

    # -- data across processes -------------------------------------------------------------------------
    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This process's contiguous share of a list, tuple, tensor or dict of them (the first processes take
        one more when it does not divide); `apply_padding` repeats the last element so every share is as long."""
        if self.num_processes == 1:
            yield inputs
            return
        length = len(next(iter(inputs.values()))) if isinstance(inputs, dict) else len(inputs)
        if isinstance(inputs, dict) and any(len(v) != length for v in inputs.values()):
            raise ValueError("All values in the dictionary must have the same length")
        per_process, extras = divmod(length, self.num_processes)
        start = self.process_index * per_process + min(self.process_index, extras)
        end = start + per_process + (1 if self.process_index < extras else 0)
        longest = per_process + (1 if extras else 0)

        def share(values):
            part = values[start:end]
            if not apply_padding or len(part) == longest:
                return part
            missing = longest - len(part)
            if isinstance(part, torch.Tensor):
                return torch.cat([part, values[-1:].expand(missing, *values.shape[1:])])
            return part + type(part)([values[-1]] * missing)

        yield {k: share(v) for k, v in inputs.items()} if isinstance(inputs, dict) else share(inputs)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        """Pad each tensor (in any nesting) along `dim` to the largest size any process holds, so it can be gathered."""

        def pad(t):
            if t.dim() == 0 or dim >= t.dim() or dim < -t.dim():
                return t
            sizes = self.gather(torch.tensor([t.shape[dim]], device=t.device))
            longest = int(sizes.max())
            if longest == t.shape[dim]:
                return t
            shape = list(t.shape)
            shape[dim] = longest
            padded = t.new_full(shape, pad_index)
            index = [slice(None)] * t.dim()
            index[dim] = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
            padded[tuple(index)] = t
            return padded

        return map_tensors(pad, tensor)

    # -- a flag any process can raise ------------------------------------------------------------------
    def set_trigger(self):
        """Raise this process's flag; check_trigger() then returns True on every process (early stopping)."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process if any process called set_trigger() since the last True (a collective)."""
        flag = getattr(self, "flag_tensor", None)
        flag = torch.tensor(0, device=self.device) if flag is None else flag
        if int(self.reduce(flag, "sum").item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False

    # -- memory and time -------------------------------------------------------------------------------
    def free_memory(self, *objects):
        """Forget every prepared object (and the given ones: the returned list holds None for each), then
        collect garbage and empty the device cache, as Accelerate's free_memory does."""
        for attribute in ("_models", "_optimizers", "_schedulers", "_dataloaders"):
            getattr(self, attribute).clear()
        self.step = self.optimizer_steps = 0
        objects = [None] * len(objects)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return objects

    clear = free_memory

    @contextlib.contextmanager
    def profile(self, profile_handler=None):
        """torch.profiler over the block, configured by an Accelerate `ProfileKwargs` (or the one passed in
        kwargs_handlers); with its output_trace_dir, each process writes profile_<rank>.json there (Accelerate's name)."""
        handler = profile_handler or self.profile_handler
        if handler is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler, trace_dir = torch.profiler.profile(activities=activities), None
        else:
            profiler, trace_dir = handler.build(), handler.output_trace_dir
        with profiler:
            yield profiler
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)
            profiler.export_chrome_trace(os.path.join(trace_dir, f"profile_{self.process_index}.json"))
            self.wait_for_everyone()
