"""`torch.nn.DataParallel`: one process drives every visible GPU.

The profile's `gpu_ids` arrive as CUDA_VISIBLE_DEVICES (`toolkit launch` sets it), so the devices this
process sees are exactly the ones asked for. DataParallel wants the module on `device_ids[0]` before it
is wrapped, and gathers outputs there.
"""

import torch

from toolkit.engines.base import TorchEngine, amp_dtype
from toolkit.engines.compiling import compile_model, uncompiled
from toolkit.errors import UserError


class AutocastModule(torch.nn.Module):
    """Runs the wrapped module under autocast with an explicit dtype. DataParallel replicates it, so each
    replica thread enters autocast itself: `parallel_apply` restarts autocast in its threads without a dtype,
    which on CUDA means fp16 (and no GradScaler) even when bf16 was asked for."""

    is_toolkit_wrapper = True  # toolkit.checkpoint.weights.unwrap_model looks through it

    def __init__(self, module, device_type, dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class DataParallelEngine(TorchEngine):
    name = "dp"

    def __init__(self, env, **kwargs):
        if env.world_size > 1:
            raise UserError(
                f"the dp engine runs in one process but this one was launched as rank {env.rank} of "
                f"{env.world_size}; launch it with plain `python` (or choose --engine ddp)."
            )
        super().__init__(env, **kwargs)
        self.device_ids = list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []
        if not self.device_ids:
            print("[toolkit] dp engine: no GPU visible, running on one CPU device.")
        # Compiled inside DataParallel (its one replica is the module itself), not over it.
        self._compile_inside, self.compile_settings = self.compile_settings, None
        if self._compile_inside is not None and len(self.device_ids) > 1:
            raise UserError(f"the dp engine cannot compile over {len(self.device_ids)} GPUs: DataParallel's replicas "
                            f"of a compiled module run the original; use --engine ddp to compile, or drop "
                            f"dynamo_backend.")

    def _wrap_model(self, model):
        # With no device ids DataParallel is a plain pass-through wrapper: same code path, one device.
        if not self.device_ids:
            return torch.nn.DataParallel(compile_model(model, self._compile_inside))
        if len(self.device_ids) > 1:
            model = self._replicable(model)
        else:
            model = compile_model(model, self._compile_inside)
        return torch.nn.DataParallel(model, device_ids=self.device_ids, output_device=self.device_ids[0])

    def _replicable(self, model):
        """What DataParallel may replicate every step: the plain module (replicas of a compiled one write
        through into the original and replace its layers), with autocast inside each replica."""
        plain = uncompiled(model)
        if plain is not model:
            print(f"[toolkit] dp engine: torch.compile does not survive DataParallel's replication over "
                  f"{len(self.device_ids)} GPUs; the model runs uncompiled (--engine ddp compiles it).")
        dtype = amp_dtype(self.mixed_precision)
        return plain if dtype is None else AutocastModule(plain, self.device.type, dtype)
