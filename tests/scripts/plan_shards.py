"""Each rank's bytes of parameters and optimizer state under the fsdp engine after one step of gpt-tiny (AdamW),
written by rank 0 as a JSON list to argv[1]: what the plan's fsdp share is checked against."""

import json
import sys

import torch

import toolkit
from toolkit.plan import workloads
from toolkit.train.optim import build_optimizer, decay_groups


def local_bytes(tensors) -> int:
    return sum(getattr(t, "_local_tensor", t).nbytes for t in tensors)


accelerator = toolkit.build_accelerator("fsdp")
work = workloads.lm("gpt-tiny", vocab=65, optimizer="adamw")
model = work.build()
optimizer = build_optimizer(work.optimizer, decay_groups(model, 0.0), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
x, y = work.example(2)
accelerator.forward_backward(model, x, y, work.loss)
optimizer.step()
mine = torch.tensor([[local_bytes(model.parameters()),
                      local_bytes(t for s in optimizer.state.values() for t in s.values() if t.ndim)]])
every = accelerator.gather(mine)
if accelerator.is_main_process:
    with open(sys.argv[1], "w") as f:
        json.dump([{"parameters": int(p), "optimizer": int(o)} for p, o in every.tolist()], f)
accelerator.end_training()
