"""Resuming mid-epoch: where a loader starts in an epoch, and a checkpoint's position mapped through samples so
that another world size resumes at the same sample.
"""

from __future__ import annotations

import itertools


def epoch_batches(loader, epoch: int, start_batch: int = 0):
    """Iterate `loader` for `epoch` from micro-batch `start_batch`. A loader that says it can
    (`resumes_mid_epoch`: MemoryLoader, StreamingLoader, the text loader) jumps there; a DataLoader is
    replayed and the first batches skipped."""
    if getattr(loader, "resumes_mid_epoch", False):
        loader.set_epoch(epoch, start_batch)
        return iter(loader)
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    return itertools.islice(iter(loader), start_batch, None)


def resume_position(state: dict, samples_per_step: int, accelerator) -> tuple[int, int, int]:
    """(step, epoch, optimizer steps of the epoch done) to continue from a checkpoint's state, mapping the
    position within the epoch through samples so that a different world size resumes at the same sample."""
    samples = int(state["samples_in_epoch"])
    if state.get("world_size") != accelerator.num_processes:
        accelerator.print(f"[toolkit] resuming a {state.get('world_size')}-process checkpoint on "
                          f"{accelerator.num_processes} process(es): epoch position mapped as {samples} samples.")
    if samples % samples_per_step:
        accelerator.print(f"[toolkit] {samples} samples into the epoch is not a whole number of "
                          f"{samples_per_step}-sample steps here; resuming at the step before.")
    return int(state["step"]), int(state["epoch"]), samples // samples_per_step
