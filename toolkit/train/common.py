"""Small pieces of a training loop that every recipe needs and no engine should own: exact evaluation,
a learning-rate schedule, BatchNorm statistics across ranks, and resuming mid-epoch.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import sys

import torch
import torch.nn.functional as F

from toolkit.data.memory import MemoryLoader


@torch.no_grad()
def evaluate(model, loader, accelerator) -> dict:
    """Accuracy and mean loss over a loader whose ranks hold DISJOINT shards of the test set (as
    `MemoryLoader(train=False)` does): per-rank sums and one all-reduce, so every sample counts exactly
    once whatever the world size and batch size. The model is unwrapped so that no DDP hook runs."""
    net = accelerator.unwrap_model(model)
    was_training = net.training
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)
    # A sharded (FSDP) model stays gathered meanwhile: ranks with one batch more than others then run
    # it alone, with no collective waiting for peers.
    with accelerator.autocast(), _full_parameters(net):
        for images, labels in loader:
            images, labels = images.to(accelerator.device), labels.to(accelerator.device)
            logits = net(images).float()
            totals[0] += (logits.argmax(1) == labels).sum()
            totals[1] += F.cross_entropy(logits, labels, reduction="sum")
            totals[2] += len(labels)
    correct, loss, count = accelerator.reduce(totals, "sum").tolist()
    net.train(was_training)
    return {"accuracy": correct / count, "loss": loss / count, "count": int(count)}


def _full_parameters(net):
    if "torch.distributed.fsdp" not in sys.modules:  # nothing can be sharded: skip importing FSDP
        return contextlib.nullcontext()
    from toolkit.engines.fsdp import full_parameters

    return full_parameters(net)


def warmup_linear_decay(total_steps: int, warmup_fraction: float = 0.2):
    """LR multiplier for step s: linear warm-up to 1 over the first steps, then linear decay to 0."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


def batchnorm_layers(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def convert_sync_batchnorm(model, accelerator):
    """`--sync-bn`: SyncBatchNorm where PyTorch supports it (several GPU ranks). Returns (model, fallback):
    on CPU ranks PyTorch refuses SyncBatchNorm, so fallback=True means "average the running statistics
    with `average_batchnorm_stats` at each checkpoint instead" (RunState.save; an evaluation follows a save)."""
    if accelerator.num_processes == 1 or not batchnorm_layers(model):
        return model, False
    if accelerator.device.type == "cuda":
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model), False
    accelerator.print("[toolkit] --sync-bn: PyTorch's SyncBatchNorm needs GPUs; averaging BatchNorm "
                      "running statistics across ranks at each checkpoint and evaluation instead.")
    return model, True


@torch.no_grad()
def average_batchnorm_stats(model, accelerator):
    """Make every rank's BatchNorm running mean/var the average over ranks, so all evaluate one model."""
    for layer in batchnorm_layers(accelerator.unwrap_model(model)):
        if layer.running_mean is not None:
            layer.running_mean.copy_(accelerator.reduce(layer.running_mean, "mean"))
            layer.running_var.copy_(accelerator.reduce(layer.running_var, "mean"))


def epoch_batches(loader, epoch: int, start_batch: int = 0):
    """Iterate `loader` for `epoch` from global step `start_batch` (mid-epoch resume). MemoryLoader jumps
    there directly, as does a loader that says it can (folder_data.StreamingLoader); a DataLoader is replayed
    and the first batches skipped."""
    if isinstance(loader, MemoryLoader) or getattr(loader, "resumes_mid_epoch", False):
        loader.set_epoch(epoch, start_batch)
        return iter(loader)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    return itertools.islice(iter(loader), start_batch, None)


def resume_position(state: dict, samples_per_step: int, accelerator) -> tuple[int, int, int]:
    """(step, epoch, start_batch) to continue from a checkpoint's state, mapping the position within the
    epoch through samples so that a different world size resumes at the same sample."""
    samples = int(state["samples_in_epoch"])
    if state.get("world_size") != accelerator.num_processes:
        accelerator.print(f"[toolkit] resuming a {state.get('world_size')}-process checkpoint on "
                          f"{accelerator.num_processes} process(es): epoch position mapped as {samples} samples.")
    if samples % samples_per_step:
        accelerator.print(f"[toolkit] {samples} samples into the epoch is not a whole number of "
                          f"{samples_per_step}-sample steps here; resuming at the step before.")
    return int(state["step"]), int(state["epoch"]), samples // samples_per_step


def is_peer_failure(error: BaseException) -> bool:
    """True for the errors a collective raises when another rank died or stopped answering."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                            "Broken pipe", "NCCL communicator was aborted", "ProcessGroupGloo"))


def peer_failure_message(error: BaseException, accelerator, step: int, timeout: float) -> str:
    first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return (f"rank {accelerator.process_index} lost contact with the other ranks at step {step} (a peer died or did "
            f"not answer within {timeout:g} s: {first_line[:160]}); checkpoints on disk are intact, "
            "relaunch with --resume auto.")


class StopRequest:
    """Ctrl-C or SIGTERM asks the loop to stop at the next optimizer-step boundary, where the state is
    consistent and a checkpoint can be written; a second Ctrl-C stops at once.

    >>> with StopRequest() as stop:
    ...     for batch in loader:
    ...         train_step(batch)
    ...         if stop.requested:
    ...             break
    """

    def __init__(self):
        self.requested = False
        self._previous = {}

    def _handle(self, signum, _frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def gather_step_status(loss, stop: StopRequest, accelerator) -> torch.Tensor:
    """One small all-gather per micro-step, left on the device: a world x 2 tensor of every rank's loss and
    whether it was asked to stop. `read_step_status` brings it to the host (the step's one sync)."""
    mine = torch.stack([loss.detach().float().reshape(()),
                        torch.tensor(float(stop.requested), device=loss.device)]).unsqueeze(0)
    return accelerator.gather(mine)


def read_step_status(status: torch.Tensor):
    """(every rank's loss, ranks whose loss is not finite, whether any rank was asked to stop), the same on
    every rank, so they skip or stop together."""
    rows = status.tolist()
    losses = [row[0] for row in rows]
    bad = [rank for rank, loss in enumerate(losses) if not math.isfinite(loss)]
    return torch.tensor(losses), bad, any(row[1] for row in rows)
