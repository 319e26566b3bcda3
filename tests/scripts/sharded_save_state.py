"""`save_state` in the sharded checkpoint format from 2 ranks (torchrun) under the engine named first: each rank
trains on its own samples, then every rank saves; rank 0 also writes what a full save would hold (the gathered
weights with rank 0's BatchNorm statistics, the optimizer's full state) and every rank's running mean to
OUT/expected.pt. tests/test_engine_api.py loads the folder in one process.

    torchrun --nproc_per_node 2 tests/scripts/sharded_save_state.py fsdp OUT
"""
import sys
from pathlib import Path

import torch

import toolkit


class Position:
    """A registered object with state_json(): its dict lands at the top of state.json."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]

    def state_json(self):
        return {"step": self.step, "epoch": 1}


def build(accelerator):
    torch.manual_seed(0)
    # Output sizes 7 and 3 do not divide by 2: the fsdp engine pads those shards. The BatchNorm's running
    # statistics are replicated, not sharded, and each rank's last batch leaves its own.
    net = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.BatchNorm1d(7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(net, optimizer, scheduler)
    position = Position()
    accelerator.register_for_checkpointing(position)
    return model, optimizer, scheduler, position


if __name__ == "__main__":
    engine, out = sys.argv[1], Path(sys.argv[2])
    accelerator = toolkit.build_accelerator(engine, cpu=True, checkpoint_format="sharded")
    model, optimizer, scheduler, position = build(accelerator)
    g = torch.Generator().manual_seed(1 + accelerator.process_index)  # each rank its own samples
    for _ in range(3):
        accelerator.backward(model(torch.randn(4, 6, generator=g)).square().mean())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        position.step += 1
    accelerator.save_state(out / "state")
    weights, optimizer_state = accelerator.get_state_dict(model), optimizer.state_dict()  # every rank: collectives
    mean = accelerator.unwrap_model(model)[1].running_mean
    means = accelerator.gather(mean.detach().clone()[None])  # each rank's running mean, rank order
    if accelerator.is_main_process:
        torch.save({"weights": weights, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
                    "running_means": means}, out / "expected.pt")
    accelerator.end_training()
