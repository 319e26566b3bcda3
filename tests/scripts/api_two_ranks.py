"""What Accelerate's process-level calls mean with a peer, under the ddp engine on 2 gloo ranks.
Writes OUT/rank<R>.json with what each rank saw (tests/test_engine_api.py reads it)."""
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit

out = Path(sys.argv[1])
accelerator = toolkit.build_accelerator("ddp", cpu=True)
rank = accelerator.process_index
seen = {}

with accelerator.split_between_processes(list(range(5))) as share:
    seen["split"] = share
with accelerator.split_between_processes(list(range(5)), apply_padding=True) as share:
    seen["split_padded"] = share
with accelerator.split_between_processes(torch.arange(5), apply_padding=True) as share:
    seen["split_tensor"] = share.tolist()
with accelerator.split_between_processes({"a": [0, 1, 2, 3, 4], "b": list("xyzvw")}) as share:
    seen["split_dict"] = share

mine = torch.full((2, 2 + rank), rank + 1)  # rank 1 holds the longer tensor
seen["padded"] = accelerator.pad_across_processes(mine, dim=1).tolist()
seen["padded_first"] = accelerator.pad_across_processes(mine, dim=1, pad_first=True).tolist()

trigger = [accelerator.check_trigger()]
if rank == 1:
    accelerator.set_trigger()
trigger += [accelerator.check_trigger(), accelerator.check_trigger()]
seen["trigger"] = trigger

ran = []
accelerator.on_main_process(lambda: ran.append("main"))()
accelerator.on_local_main_process(lambda: ran.append("local_main"))()
accelerator.on_last_process(lambda: ran.append("last"))()
accelerator.on_process(process_index=1)(lambda: ran.append("process 1"))()
seen["ran"] = ran

loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
gathered, seen["loader_epoch"] = [], []
for (x,) in loader:  # 9 samples, 2 per rank per batch: 5 a rank (one a repeat), the last global batch holds 1
    gathered.append(accelerator.gather_for_metrics(x))
    seen["loader_epoch"].append([x.tolist(), loader.end_of_dataloader, loader.remainder])
seen["eval"] = torch.cat(gathered).tolist()
seen["loader_sizes"] = [loader.total_dataset_length, len(loader.get_sampler()), loader.total_batch_size]
loader.set_sampler(range(8, -1, -1))  # the whole dataset backwards: each rank still takes its share of it
seen["set_sampler_mine"] = [x.tolist() for (x,) in loader]
seen["set_sampler_eval"] = torch.cat([accelerator.gather_for_metrics(x) for (x,) in loader]).tolist()
seen["gathered_objects"] = accelerator.gather_for_metrics([f"r{rank}"], use_gather_object=True)

with accelerator.main_process_first():
    if rank == 0:
        time.sleep(0.5)  # the other rank must still wait for this one
    seen["order"] = time.time()

model = accelerator.prepare(torch.nn.Linear(2, 2))
accelerator.set_seed(11)  # rank-specific streams: each rank must get its own back
folder = out / "state"
accelerator.save_state(folder)
expected = torch.rand(3)
torch.manual_seed(1234)
accelerator.load_state(folder)
seen["rng_restored"] = torch.equal(torch.rand(3), expected)
seen["rng_files"] = sorted(p for p in os.listdir(folder) if p.startswith("random_states"))

# Accelerate's LocalSGD (examples/by_feature/local_sgd.py): ranks step apart, then average every 2 steps.
from accelerate.local_sgd import LocalSGD

torch.manual_seed(0)
local_model, local_optimizer = accelerator.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
local_optimizer = accelerator.prepare(torch.optim.SGD(local_model.parameters(), lr=0.1))
after = []
with LocalSGD(accelerator=accelerator, model=local_model, local_sgd_steps=2, enabled=True) as local_sgd:
    for _ in range(3):
        with accelerator.accumulate(local_model):
            accelerator.backward(local_model(torch.full((4, 2), float(rank + 1))).sum())  # rank-dependent
            local_optimizer.step()
            local_optimizer.zero_grad()
            local_sgd.step()
        after.append(accelerator.gather(accelerator.unwrap_model(local_model).weight.detach().reshape(1, -1)).tolist())
seen["local_sgd_in_step"] = [rows[0] == rows[1] for rows in after]  # apart, averaged, apart

(out / f"rank{rank}.json").write_text(json.dumps(seen))
accelerator.end_training()
