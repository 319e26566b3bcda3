"""The recipes' checkpoints and Accelerate's are one format: a real `Accelerator.load_state` restores a recipe's
step folder, and a recipe's `--resume` takes a folder a real `Accelerator.save_state` wrote (no manifest, no
recipe position: the position follows from its schedule's step count)."""

import safetensors.torch
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from conftest import PY, ROOT, run

from toolkit.models.nets import build_model
from toolkit.checkpoint.functional import latest_checkpoint
from toolkit.train.optim import warmup_linear_decay

CIFAR = ROOT / "recipes" / "cifar.py"
RECIPE = [PY, CIFAR, "--dataset", "synthetic", "--model", "tiny", "--epochs", 1, "--global-batch-size", 250,
          "--lr", 0.05, "--seed", 3]  # 5000 images: 20 steps in the epoch


def recipe_training(accelerator):
    """The recipe's model, optimizer (two groups: no decay on biases and norms) and schedule, prepared."""
    torch.manual_seed(3)
    model = build_model("tiny", 10)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=0.05, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(20, 0.0))
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler


class Position:
    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        self.state = state


def test_a_real_accelerator_restores_a_recipe_checkpoint(tmp_path):
    out = tmp_path / "run"
    run(RECIPE + ["--max-steps", 4, "--output-dir", out])
    folder = latest_checkpoint(out / "checkpoints")
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = recipe_training(accelerator)
    position = Position()  # the recipe registers its schedule and its run's position, in that order
    accelerator.register_for_checkpointing(scheduler, position)
    accelerator.load_state(folder)
    assert scheduler.last_epoch == 4 and (position.state["step"], position.state["samples_in_epoch"]) == (4, 1000)
    saved = safetensors.torch.load_file(folder / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in accelerator.get_state_dict(model).items())
    momentum = optimizer.state_dict()["state"]
    assert len(momentum) == len(list(model.parameters())) and all(s["momentum_buffer"].abs().sum() > 0
                                                                  for s in momentum.values())
    AcceleratorState._reset_state(True)


def test_the_recipe_resumes_from_a_folder_a_real_accelerator_saved(tmp_path):
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = recipe_training(accelerator)
    accelerator.register_for_checkpointing(scheduler)  # how an Accelerate script keeps a hand-stepped schedule
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for _ in range(5):
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.save_state(tmp_path / "accelerate_folder")
    AcceleratorState._reset_state(True)
    # Registered objects are Accelerate's custom_checkpoint_0.pkl; the recipe's schedule is its scheduler.bin.
    (tmp_path / "accelerate_folder" / "custom_checkpoint_0.pkl").rename(tmp_path / "accelerate_folder" / "scheduler.bin")
    proc = run(RECIPE + ["--resume", tmp_path / "accelerate_folder", "--output-dir", tmp_path / "out"])
    assert "save_state folder without the recipe's position: step 5" in proc.stdout, proc.stdout
    summary = (tmp_path / "out" / "summary.json").read_text()
    steps = [line.split(",")[2] for line in (tmp_path / "out" / "steps.csv").read_text().splitlines()[1:]]
    assert '"steps": 20' in summary and steps == [str(s) for s in range(6, 21)]  # steps 6-20 trained, not 1-20
