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


def train_with_average(out_dir: str, engine: str, resume: str = ""):
    """The tiny net 4 SGD steps at global batch 16 under `engine`, a WeightEMA (decay 0.5) updated after each; then
    save_state to OUT_DIR/state. With `resume`, load that folder first and train nothing. Rank 0 writes the
    average as save_state gathered it, and the model's weights while the average is swapped in, to OUT_DIR."""
    import toolkit
    from toolkit.data.memory import MemoryLoader
    from toolkit.models.nets import build_model
    from toolkit.train import WeightEMA

    accelerator = toolkit.build_accelerator(engine)
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(build_model("tiny", 10)))
    ema = WeightEMA(model, 0.5, accelerator)
    accelerator.register_for_checkpointing(ema)
    g = torch.Generator().manual_seed(1)
    images, labels = torch.randint(0, 256, (64, 3, 32, 32), generator=g, dtype=torch.uint8), torch.arange(64) % 10
    loader = MemoryLoader(images, labels, GLOBAL_BATCH // accelerator.num_processes, rank=accelerator.process_index,
                          world_size=accelerator.num_processes, seed=0, augment="none")
    if resume:
        accelerator.load_state(resume)
    else:
        for _, (x, y) in zip(range(STEPS), loader):
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            ema.update()
    accelerator.save_state(str(Path(out_dir) / "state"))
    with ema.swapped():
        swapped = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}  # gathered under fsdp
    if accelerator.is_main_process:
        saved = torch.load(Path(out_dir) / "state" / "custom_checkpoint_0.pkl", weights_only=True)
        (Path(out_dir) / "average.json").write_text(json.dumps(
            {"updates": saved["updates"], "average": {k: v.tolist() for k, v in saved["average"].items()},
             "swapped": {k: v.tolist() for k, v in swapped.items()}}))
