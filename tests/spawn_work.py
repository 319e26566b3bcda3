"""Training functions that tests start with toolkit.spawn and accelerate.notebook_launcher (importable, so the
"spawn" start method can pickle them by name)."""

import json
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS, GLOBAL_BATCH, SAMPLES = 4, 16, 5  # SAMPLES does not divide over 2 ranks: gather_for_metrics must unpad


def train(out_dir: str):
    """Build the accelerator from the launch environment, train the tiny net 4 steps at global batch 16 with the
    toolkit's MemoryLoader, gather 5 numbered samples; rank 0 writes what it saw to OUT_DIR."""
    import toolkit
    from toolkit.data.memory import MemoryLoader
    from toolkit.models.nets import build_model

    accelerator = toolkit.build_accelerator()
    torch.manual_seed(0)
    model = build_model("tiny", 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randint(0, 256, (64, 3, 32, 32), generator=g, dtype=torch.uint8), torch.arange(64) % 10
    loader = MemoryLoader(images, labels, GLOBAL_BATCH // accelerator.num_processes, rank=accelerator.process_index,
                          world_size=accelerator.num_processes, seed=0, augment="none")
    for _, (x, y) in zip(range(STEPS), loader):
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    numbered = accelerator.prepare(torch.utils.data.DataLoader(torch.arange(SAMPLES), batch_size=2))
    seen = torch.cat([accelerator.gather_for_metrics(batch) for batch in numbered]).tolist()
    if accelerator.is_main_process:
        weights = {k: v.tolist() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "result.json").write_text(json.dumps(
            {"engine": accelerator.name, "world_size": accelerator.num_processes, "device": str(accelerator.device),
             "launcher": accelerator.env.launcher, "gathered": seen, "weights": weights}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def fail_on_rank_one():
    import toolkit

    accelerator = toolkit.build_accelerator()
    if accelerator.process_index == 1:
        raise ValueError("rank one's data folder is empty")
    accelerator.end_training()
