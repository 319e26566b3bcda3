"""`--profile-steps A:B`: torch.profiler over optimizer steps A to B (counted from 1, both included) on every rank,
CPU and CUDA activities with shapes (and memory, on a GPU); one Chrome/Perfetto trace per rank in OUTPUT_DIR/profile and the
ten ops that took the most time, in the log and in OUTPUT_DIR/profile/top-ops.txt (main process).

    >>> parse_steps("3:5")
    (3, 5)
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

from toolkit.errors import UserError


def parse_steps(text: str) -> tuple[int, int]:
    """'A:B' as (A, B), 1 <= A <= B; one sentence otherwise."""
    first, _, last = text.partition(":")
    try:
        steps = int(first), int(last or first)
    except ValueError:
        steps = None
    if steps is None or not 1 <= steps[0] <= steps[1]:
        raise UserError(f"--profile-steps {text}: give the optimizer steps to profile as A:B with 1 <= A <= B, "
                        "such as 3:5.")
    return steps


class StepProfiler:
    """Starts torch.profiler before step `first` and stops it after step `last`, writing the traces; `tick(step)`
    is called with the steps done so far, before each step begins (and after each ends)."""

    def __init__(self, steps: str | None, folder: Path, rank: int, is_main: bool, say):
        self.first, self.last = parse_steps(steps) if steps else (None, None)
        self.folder, self.rank, self.is_main, self.say = Path(folder), rank, is_main, say
        self._profiler = None
        self.done = steps is None

    def tick(self, steps_done: int):
        if self.done:
            return
        if self._profiler is None and steps_done == self.first - 1:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            # Memory is profiled on a GPU; on a CPU the process's peak is in the evaluation line, and torch's CPU
            # allocator would warn about every block allocated before the window.
            self._profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                                     record_shapes=True, profile_memory=cuda)
            with _quiet_stderr():  # kineto's own start line
                self._profiler.__enter__()
        elif self._profiler is not None and steps_done >= self.last:
            self._finish()
        elif self._profiler is None and steps_done >= self.first:  # resumed past the window: nothing to profile
            self.done = True

    def close(self):
        """At the run's end: a window past its last step is written as far as it got."""
        if self._profiler is not None:
            self._finish()

    def _finish(self):
        profiler, self._profiler, self.done = self._profiler, None, True
        with _quiet_stderr():  # kineto's stop line (and, on a CPU, that it found no GPU)
            profiler.__exit__(None, None, None)
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"trace-rank{self.rank}-steps{self.first}-{self.last}.json"
        profiler.export_chrome_trace(str(trace))
        if self.is_main:
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=sort, row_limit=10)
            (self.folder / "top-ops.txt").write_text(table + "\n")
            self.say(f"[toolkit] --profile-steps {self.first}:{self.last}: one trace per rank in {self.folder} "
                     f"(open in ui.perfetto.dev or chrome://tracing); the ten ops that took the most time:\n{table}")


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for a moment: kineto writes its lifecycle lines from C++."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
