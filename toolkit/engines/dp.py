"""`torch.nn.DataParallel`: one process drives every visible GPU.

The profile's `gpu_ids` arrive as CUDA_VISIBLE_DEVICES (`toolkit launch` sets it), so the devices this
process sees are exactly the ones asked for. DataParallel wants the module on `device_ids[0]` before it
is wrapped, and gathers outputs there.
"""

import torch

from toolkit.engines.base import TorchEngine


class DataParallelEngine(TorchEngine):
    name = "dp"

    def __init__(self, env, **kwargs):
        if env.world_size > 1:
            from toolkit.errors import UserError

            raise UserError(
                f"the dp engine runs in one process but this one was launched as rank {env.rank} of "
                f"{env.world_size}; launch it with plain `python` (or choose --engine ddp)."
            )
        super().__init__(env, **kwargs)
        self.device_ids = list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []
        if not self.device_ids:
            print("[toolkit] dp engine: no GPU visible, running on one CPU device.")

    def _wrap_model(self, model):
        # With no device ids DataParallel is a plain pass-through wrapper: same code path, one device.
        if not self.device_ids:
            return torch.nn.DataParallel(model)
        return torch.nn.DataParallel(model, device_ids=self.device_ids, output_device=self.device_ids[0])
