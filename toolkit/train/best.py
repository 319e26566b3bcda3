"""--keep-best: the best evaluation so far and its checkpoint, `checkpoints/best` and best.json beside `latest`,
spared by the --keep pruning and kept across resumes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from toolkit.checkpoint.functional import checkpoint_folder, mark_best

# The metric -> (its key in EvalMetrics.compute()'s dict, whether higher is better).
BEST_METRICS = {"test_accuracy": ("accuracy", True), "test_loss": ("loss", False)}


class BestCheckpoint:
    """The best evaluation {"metric", "value", "step", "folder"} of a run's checkpoints under `checkpoints`.
    Every rank keeps it (it is saved in state.json); the main process marks the folder."""

    def __init__(self, metric: str | None, checkpoints: Path, keep: int | None, is_main_process: bool, say):
        self.metric, self.checkpoints, self.keep, self.is_main_process, self.say = (metric, checkpoints, keep,
                                                                                    is_main_process, say)
        self.best = None

    def evaluated(self, metrics: dict, step: int):
        """When this evaluation beats every earlier one, step `step`'s checkpoint becomes the best."""
        key, higher = BEST_METRICS[self.metric]
        value, best = metrics[key], self.best and self.best["value"]
        if not math.isfinite(value) or best is not None and not (value > best if higher else value < best):
            return
        folder = checkpoint_folder(self.checkpoints, step)
        self.best = {"metric": self.metric, "value": value, "step": step, "folder": folder.name}
        if not self.is_main_process:
            return
        if folder.is_dir():
            mark_best(self.checkpoints, folder, {k: v for k, v in self.best.items() if k != "folder"}, self.keep)
        else:
            self.say(f"[toolkit] warning: --keep-best: no checkpoint of step {step} to keep; save one with "
                     "run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder())) before evaluating.")

    def resumed(self, saved, step: int):
        """The best up to the resumed step: the checkpoint's (None in an older one), or best.json's when it is
        later. A checkpoint is saved just before its step's evaluation, so it cannot hold that one; a best.json
        past the resumed step is another timeline's, and ignored."""
        try:
            written = json.loads((self.checkpoints / "best.json").read_text())
        except (OSError, ValueError):
            written = None
        found = [best for best in (saved, written)
                 if isinstance(best, dict) and best.get("metric") == self.metric
                 and isinstance(best.get("value"), (int, float)) and isinstance(best.get("step"), int)
                 and isinstance(best.get("folder"), str) and best["step"] <= step]
        self.best = max(found, key=lambda best: best["step"], default=None)
