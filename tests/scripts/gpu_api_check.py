"""The Accelerator API on one GPU, under every engine in turn (tests/test_gpu.py runs it): fp16 and bf16 steps,
save_state/load_state both ways with a real Accelerator, fsdp with a scalar parameter, trackers. Prints one
`API OK <engine> <precision>` line per case and `ALL OK` at the end (an AssertionError otherwise)."""
import sys
import tempfile
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import toolkit


class Net(torch.nn.Module):
    def __init__(self, scalar=True):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        # a scalar: fsdp keeps it whole (and refuses fp16 with it: GradScaler cannot mix whole and sharded)
        self.temperature = torch.nn.Parameter(torch.tensor(1.5)) if scalar else None

    def forward(self, x):
        return self.body(x) / (self.temperature if self.temperature is not None else 1.0)


def setup(accelerator, scalar=True):
    torch.manual_seed(7)
    net = Net(scalar)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.9)
    return accelerator.prepare(net, optimizer, scheduler)


def train(accelerator, model, optimizer, scheduler, steps):
    for step in range(steps):
        x = torch.randn(16, 8, device=accelerator.device) * (10.0 if step == 0 else 1.0)
        with accelerator.accumulate(model):
            loss = model(x).float().square().mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if not accelerator.optimizer_step_was_skipped:
                scheduler.step()
            optimizer.zero_grad()
    return loss.item()


def weights(accelerator, model):
    return {k: v.detach().float().cpu().clone() for k, v in accelerator.get_state_dict(model).items()}


def check(engine, precision, folder):
    accelerator = toolkit.build_accelerator(engine, mixed_precision=precision, gradient_accumulation_steps=2,
                                            log_with="jsonl", project_dir=str(folder))
    assert accelerator.device.type == "cuda", accelerator.device
    accelerator.init_trackers("gpu", config={"engine": engine, "precision": precision})
    scalar = not (engine == "fsdp" and precision == "fp16")
    if not scalar:
        try:
            setup(accelerator)
            raise AssertionError("fsdp took fp16 with a whole scalar parameter")
        except toolkit.UserError as error:
            assert "cannot train fp16 with parameters it keeps whole (temperature" in str(error), error
    model, optimizer, scheduler = setup(accelerator, scalar)
    loss = train(accelerator, model, optimizer, scheduler, 6)
    assert torch.isfinite(torch.tensor(loss)), loss
    accelerator.log({"loss": loss}, step=6)
    accelerator.save_state(folder / "state")
    saved = weights(accelerator, model)
    accelerator.end_training()
    AcceleratorState._reset_state(True)
    real = Accelerator(mixed_precision=precision)  # a real Accelerator on the same GPU reads the folder
    model2, optimizer2, scheduler2 = setup(real, scalar)
    real.load_state(str(folder / "state"))
    assert all(torch.equal(v, saved[k]) for k, v in weights(real, model2).items())
    assert scheduler2.scheduler.last_epoch == scheduler.scheduler.last_epoch
    real.save_state(str(folder / "back"))
    AcceleratorState._reset_state(True)
    again = toolkit.build_accelerator(engine, mixed_precision=precision, gradient_accumulation_steps=2)
    model3, optimizer3, scheduler3 = setup(again, scalar)
    again.load_state(folder / "back")
    assert all(torch.equal(v, saved[k]) for k, v in weights(again, model3).items())
    again.end_training()
    AcceleratorState._reset_state(True)
    assert '"loss"' in (folder / "gpu" / "log.jsonl").read_text()
    print(f"API OK {engine} {precision}", flush=True)


cases = [(e, p) for e in ("single", "dp", "ddp", "fsdp", "accelerate") for p in ("bf16", "fp16")]
if len(sys.argv) > 1:
    cases = [c for c in cases if c[0] in sys.argv[1:]]
with tempfile.TemporaryDirectory() as root:
    for engine, precision in cases:
        check(engine, precision, Path(root) / f"{engine}-{precision}")
print("ALL OK")
