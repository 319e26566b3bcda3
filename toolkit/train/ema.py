"""An exponential moving average of the weights (`--ema-decay`), kept beside the model on every engine: updated once
per optimizer step, evaluated by swapping it into the model, saved with every `save_state` and restored exactly.

    ema = WeightEMA(model, cfg.ema_decay, accelerator)      # after prepare: under fsdp each rank averages its shards
    accelerator.register_for_checkpointing(scheduler, run, ema)
    ...
    if accelerator.sync_gradients:                          # once per optimizer step, never per micro-step
        ema.update()
    ...
    with ema.swapped():                                     # the averaged weights in the model, then its own back
        ema_metrics = evaluate(model, test_loader, accelerator)

The decay warms up as TensorFlow's ExponentialMovingAverage(num_updates) does: update t uses
min(decay, (1 + t) / (10 + t)), so a short run's average is not dominated by the initial weights. Only trainable
parameters are averaged; BatchNorm statistics and other buffers are the model's own. Under fsdp the average is
kept as each rank's shards of the parameters (no extra memory per rank beyond 1/W of the model), gathered whole
only to be saved, so a checkpoint's average resumes at any world size and under any engine.
"""

from __future__ import annotations

import contextlib

import torch

from toolkit.errors import UserError


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the parameters of an fsdp model), any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WeightEMA:
    """The moving average of `model`'s trainable parameters (a prepared model: under fsdp its sharded ones), updated
    by `update()`; a registered checkpointing object (`state_dict` holds the whole tensors by parameter name)."""

    def __init__(self, model, decay: float, accelerator):
        if not 0 < decay < 1:
            raise UserError(f"--ema-decay must be in (0, 1), such as 0.999, not {decay}.")
        self.decay, self.updates, self.accelerator = decay, 0, accelerator
        named = [(name, p) for name, p in accelerator.unwrap_model(model, keep_torch_compile=False).named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.shadow = [_local(p).detach().clone() for p in self.params]  # this rank's part of each parameter
        self._whole = None  # the gathered average, set on every rank just before a save (a collective under fsdp)
        accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: self._gather())

    def current_decay(self) -> float:
        """The decay the next update uses."""
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self):
        """average <- decay x average + (1 - decay) x weights, once per optimizer step (after `optimizer.step()`)."""
        weight = 1 - self.current_decay()
        torch._foreach_lerp_(self.shadow, [_local(p).detach() for p in self.params], weight)
        self.updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped(self):
        """The average in the model's parameters until exit, then the model's own weights back, bit for bit."""
        own = [_local(p).detach().clone() for p in self.params]
        for p, average in zip(self.params, self.shadow):
            _local(p).copy_(average)
        try:
            yield
        finally:
            for p, kept in zip(self.params, own):
                _local(p).copy_(kept)

    # -- checkpointing ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def _gather(self):
        self._whole = {name: self._whole_tensor(p, average).cpu() for name, p, average
                       in zip(self.names, self.params, self.shadow)}

    def _whole_tensor(self, param, average):
        if hasattr(param, "to_local"):  # a sharded parameter: the shards of every rank, joined
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(average, param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride()).full_tensor()
        return average.detach().clone()

    def state_dict(self) -> dict:
        """The average as whole tensors by parameter name, the decay and the update count (main process: gathered
        by the save_state pre-hook every rank ran)."""
        if self._whole is None:
            if any(hasattr(p, "to_local") for p in self.params):
                raise UserError("WeightEMA.state_dict is gathered by save_state on every rank; call save_state, "
                                "not state_dict, to save a sharded model's average.")
            self._gather()
        whole, self._whole = self._whole, None
        return {"decay": self.decay, "updates": self.updates, "average": whole}

    @torch.no_grad()
    def load_state_dict(self, state: dict):
        average = state.get("average") if isinstance(state, dict) else None
        if not isinstance(average, dict) or set(average) != set(self.names):
            raise UserError("the checkpoint's weight average (--ema-decay) does not name this model's parameters; "
                            "resume with the model it was saved with.")
        self.updates = int(state["updates"])
        for i, (name, param) in enumerate(zip(self.names, self.params)):
            whole = average[name].to(device=self.shadow[i].device, dtype=self.shadow[i].dtype)
            if hasattr(param, "to_local"):  # this rank's shard of the whole tensor, as fully_shard cut the parameter
                from torch.distributed.tensor import distribute_tensor

                whole = distribute_tensor(whole, param.device_mesh, param.placements).to_local()
            self.shadow[i].copy_(whole)
