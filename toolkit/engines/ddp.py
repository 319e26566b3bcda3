"""Raw `torch.distributed` + `DistributedDataParallel`, as launched by torchrun (no Accelerate here): the world
of processes is engines/group.py's, and this engine wraps each model in DDP.
"""

from __future__ import annotations

import contextlib
import weakref

from torch.nn.parallel import DistributedDataParallel

from toolkit.engines.base import TorchEngine
from toolkit.engines.group import ProcessGroupMixin


class RawDDPEngine(ProcessGroupMixin, TorchEngine):
    name = "ddp"
    distributed_type = property(lambda self: "MULTI_GPU" if self.device.type == "cuda" else "MULTI_CPU")

    def _wrap_model(self, model):
        if self._world == 1:
            # Nothing to synchronise, and DDP's per-step bookkeeping cost 6-13% of a small model's step here
            # (benchmarks/engine_overhead.py); accelerate does not wrap a world of one either.
            return model
        # Gradients live in DDP's communication buckets: no copy in or out of them each step.
        kwargs = {"gradient_as_bucket_view": True}
        if self.device.type == "cuda":
            kwargs.update(device_ids=[self.device.index], output_device=self.device.index)
        handler = self.ddp_handler  # the script's DistributedDataParallelKwargs, as Accelerate passes them on
        if handler is not None:
            kwargs.update({k: v for k, v in handler.to_kwargs().items() if not k.startswith("comm_")})
        wrapped = DistributedDataParallel(model, **kwargs)
        if handler is not None and hasattr(handler, "register_comm_hook"):
            handler.register_comm_hook(wrapped)
        self._wrapped.append(weakref.ref(wrapped))
        return wrapped

    def _no_sync(self, model):
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    @contextlib.contextmanager
    def _trigger_sync(self, model):
        """Accelerate's trigger_sync_in_backward: the next backward all-reduces even after a no_sync forward."""
        if not isinstance(model, DistributedDataParallel):
            yield
            return
        backward, forward = model.require_backward_grad_sync, model.require_forward_param_sync
        model.require_backward_grad_sync = model.require_forward_param_sync = True
        model.reducer.prepare_for_backward([])
        try:
            yield
        finally:
            model.require_backward_grad_sync, model.require_forward_param_sync = backward, forward
