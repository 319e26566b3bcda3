"""Checkpoints both ways: `save_state` under one engine (or Accelerate's own Accelerator), `load_state` under
another, at the same world size. Only how the Accelerator is built depends on --engine.

    python tests/scripts/conformance/state_roundtrip.py save --engine fsdp --folder /tmp/state --out /tmp/saved.json
    python tests/scripts/conformance/state_roundtrip.py load --engine real --folder /tmp/state --out /tmp/loaded.json
    torchrun --nproc_per_node 2 tests/scripts/conformance/state_roundtrip.py save --engine ddp ...

`save` trains 3 steps (AdamW, a StepLR schedule, a registered step counter; each process its own samples,
each its own RNG stream), saves, then records what a checkpoint must carry over; `load` builds everything
anew from another seed, loads the folder and records the same things. They agree when the folder restored
the model, the optimizer (the next step's weights), the scheduler, each process's RNG (the next draws) and
the registered object.
"""

import argparse
import random

import numpy
import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from toy_task import DATA_SEED, SEED, Classifier, build_accelerator, classification_data, write_json

STEPS, PER_PROCESS = 3, 4


class StepCounter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def build(engine, seed):
    accelerator = build_accelerator(engine, cpu=True)
    # Each process its own RNG stream, so that each must get its own back. (Not Accelerate's
    # set_seed(device_specific=True): it reads Accelerate's process state, which only a real Accelerator sets up.)
    set_seed(seed + accelerator.process_index)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counter = StepCounter()
    accelerator.register_for_checkpointing(counter)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler, counter


def train_step(accelerator, model, optimizer, scheduler, counter):
    features, labels, _ = classification_data(64, DATA_SEED).tensors
    start = (counter.count * accelerator.num_processes + accelerator.process_index) * PER_PROCESS
    features, labels = features[start:start + PER_PROCESS], labels[start:start + PER_PROCESS]
    loss = F.cross_entropy(model(features.to(accelerator.device)), labels.to(accelerator.device))
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    counter.count += 1


def plain(state_dict):
    return {name: tensor.detach().cpu().float().reshape(-1).tolist() for name, tensor in state_dict.items()}


def observe(accelerator, model, optimizer, scheduler, counter) -> dict:
    """What the checkpoint carried over, read the same way after save_state and after load_state; then one
    more step (it uses the optimizer's moments and the scheduler's learning rate)."""
    draws = torch.cat([torch.rand(3), torch.tensor([random.random(), numpy.random.rand()])])
    observed = {
        "draws": accelerator.gather(draws.to(accelerator.device)).view(accelerator.num_processes, -1).tolist(),
        "counter": counter.count,
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k in ("last_epoch", "_step_count", "_last_lr")},
        "weights": plain(accelerator.get_state_dict(model)),  # every process calls it (fsdp gathers)
        "optimizer": optimizer.state_dict(),  # every process calls it too; the main one's is the full state
    }
    observed["optimizer"] = {"lr": [g["lr"] for g in observed["optimizer"].get("param_groups", [])],
                             "state": {str(i): plain(s) for i, s in observed["optimizer"].get("state", {}).items()}}
    train_step(accelerator, model, optimizer, scheduler, counter)
    observed["weights_after_next_step"] = plain(accelerator.get_state_dict(model))
    return observed


def save(engine, folder, out):
    accelerator, *objects = build(engine, SEED)
    for _ in range(STEPS):
        train_step(accelerator, *objects)
    accelerator.save_state(folder)
    observed = observe(accelerator, *objects)
    if accelerator.is_main_process:
        write_json(out, observed)


def load(engine, folder, out):
    accelerator, *objects = build(engine, SEED + 100)  # what the folder does not restore comes out different
    accelerator.load_state(folder)
    observed = observe(accelerator, *objects)
    if accelerator.is_main_process:
        write_json(out, observed)


def main():
    parser = argparse.ArgumentParser(description="save_state under one engine, load_state under another.")
    parser.add_argument("action", choices=("save", "load"))
    parser.add_argument("--engine", default="real", help="real (accelerate.Accelerator) or a toolkit engine")
    parser.add_argument("--folder", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    (save if args.action == "save" else load)(args.engine, args.folder, args.out)


if __name__ == "__main__":
    main()
