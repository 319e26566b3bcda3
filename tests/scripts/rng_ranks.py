"""Two ranks save one checkpoint, draw, restore it and draw again: each must get its own draws back.
The ranks are seeded differently (seed + rank), so restoring rank 0's state on rank 1 shows up."""
import sys

import torch

import toolkit
from toolkit.checkpoint.functional import gather_rng_states, load_checkpoint, save_checkpoint

accelerator = toolkit.build_accelerator("ddp")
accelerator.set_seed(0)
states = gather_rng_states()  # a collective: every rank calls it, rank 0 writes
expected = torch.rand(3)  # what each rank draws next from the saved state
if accelerator.is_main_process:
    save_checkpoint(sys.argv[1], 1, model=torch.nn.Linear(1, 1), rng_states=states)
accelerator.wait_for_everyone()
load_checkpoint(sys.argv[1])
got = torch.rand(3)
print(f"rank {accelerator.process_index}: {'own rng restored' if torch.equal(expected, got) else 'WRONG rng'}",
      flush=True)
accelerator.end_training()
