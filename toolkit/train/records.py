"""Run records: per-step and per-epoch metrics (JSONL + CSV), a progress bar and a final summary.json, all
written by the main process only (nothing duplicated per rank). Experiment trackers (TensorBoard, Trackio)
are the engine's: `--log-with` and `accelerator.log` (toolkit/engines/tracking.py).

Files are appended to, never truncated: a resumed run keeps what the interrupted one wrote, and its `time`
column goes on from the checkpoint's (`continue_from`) as the `step` and `images` columns do.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from toolkit.config import config_text, config_values
from toolkit.errors import UserError


def git_commit(path: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def hardware() -> dict:
    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def versions() -> dict:
    import importlib.metadata as md

    found = {}
    for package in ("torch", "torchvision", "accelerate", "datasets"):
        try:
            found[package] = md.version(package)
        except md.PackageNotFoundError:
            found[package] = None
    found["cuda"] = torch.version.cuda
    return found


class Throughput:
    """Images per second after the first `warmup_steps` optimizer steps, whose stall (allocator, caches,
    threads, compilation) would otherwise set the figure (1,437 and 3,612 images/s on two identical runs);
    the warm-up's own time is kept apart.

    >>> meter = Throughput(warmup_steps=1)
    >>> meter.step(100, 5.0); meter.step(100, 0.5); meter.step(100, 0.5)
    >>> meter.images_per_s, meter.warmup_s
    (200.0, 5.0)
    """

    def __init__(self, warmup_steps: int = 5):
        self.warmup_steps = warmup_steps
        self.steps, self.images, self.seconds = 0, 0, 0.0
        self.warm_images, self.warmup_s = 0, 0.0

    def step(self, images: int, seconds: float):
        """One optimizer step of `images` images over all ranks that took `seconds`."""
        self.steps, self.images, self.seconds = self.steps + 1, self.images + images, self.seconds + seconds
        if self.steps <= self.warmup_steps:
            self.warm_images, self.warmup_s = self.images, self.seconds

    @property
    def images_per_s(self) -> float | None:
        """After the warm-up; over every step when the run was no longer than its warm-up."""
        images, seconds = self.images - self.warm_images, self.seconds - self.warmup_s
        if seconds <= 0:
            images, seconds = self.images, self.seconds
        return round(images / seconds, 1) if seconds > 0 else None


def check_fresh_output_dir(output_dir: str | Path, resume: str | None, restarts: int = 0, parity: bool = False):
    """Refuse to start a new run in a folder that already holds one: both runs' rows would mix in the
    metrics files and the new run would prune the old one's checkpoints. Resuming (--resume, or a restart
    by torchrun/toolkit launch: `restarts` > 0, and it resumes on its own) and `toolkit parity` (`parity`: its
    two sides share the script's arguments for a few steps) continue in it on purpose.

    >>> check_fresh_output_dir("/nonexistent/run", None)
    """
    if resume is not None or restarts or parity:
        return
    path = Path(output_dir)
    # hf_cache/: the dataset cache recipes/images.py keeps there (written before this check runs), not a run's.
    if path.is_dir() and any(p.name != "hf_cache" for p in path.iterdir()):
        raise UserError(f"--output-dir {path} already holds files of another run; continue that run with "
                        "--resume auto, or pass a fresh folder.")
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path} is a file, not a folder; pass a fresh folder.")


class RunRecorder:
    """Metrics for one run in `output_dir`; every method is a no-op off the main process.

    >>> import tempfile
    >>> folder = tempfile.mkdtemp()
    >>> records = RunRecorder(folder, active=True)
    >>> records.log("step", step=1, loss=2.3)
    >>> records.close()
    >>> open(f"{folder}/steps.csv").read().splitlines()[0]
    'kind,time,step,loss'
    """

    def __init__(self, output_dir: str | Path, active: bool):
        self.active = active
        self.dir = Path(output_dir)
        self.opened = self.started = time.time()
        self._csv: dict[str, tuple] = {}
        if not active:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a")

    def write_config(self, cfg, resolved: dict):
        """config.yaml: the run's flags as they ran (`resolved`'s values: the presets' and the plan's micro-batch),
        a file `--config` takes back to train the same run again."""
        if self.active:
            values = {name: resolved[name] for name in config_values(cfg)}
            (self.dir / "config.yaml").write_text(config_text(values, "yaml"))

    def continue_from(self, elapsed_s: float):
        """Count the `time` column on from `elapsed_s`, the seconds the run had trained when its checkpoint was
        written: a resume's rows go on from there, not from 0."""
        self.started = self.opened - elapsed_s

    def last_step(self) -> int | None:
        """The last optimizer step metrics.jsonl records (an interrupted attempt's may lie past its checkpoint's
        step); None when it holds none or this process does not write the records."""
        path = self.dir / "metrics.jsonl"
        if not self.active or not path.is_file():
            return None
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 65536))  # the file's end: the last rows
            lines = f.read().decode(errors="replace").splitlines()
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except ValueError:  # the first, cut line; a line a killed process left half written
                continue
            if isinstance(row, dict) and row.get("kind") == "step" and isinstance(row.get("step"), int):
                return row["step"]
        return None

    def log(self, kind: str, **values):
        """Append one row of `kind` ("step", "epoch", ...) to metrics.jsonl and KIND.csv. KIND.csv keeps the columns
        of its header (the first row's, or the file's when a resume appends to it): a value the header lacks goes
        to metrics.jsonl alone, one it has and the row lacks is left empty.

        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> for row in ({"step": 1, "test_accuracy": 0.5}, {"step": 2, "test_accuracy": 0.7, "test_top5_accuracy": 1}):
        ...     records = RunRecorder(folder, active=True)  # a run, then its resume
        ...     records.log("epoch", **row)
        ...     records.close()
        >>> open(f"{folder}/epochs.csv").read().splitlines()[0]
        'kind,time,step,test_accuracy'
        """
        if not self.active:
            return
        row = {"kind": kind, "time": round(time.time() - self.started, 3), **values}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if kind not in self._csv:
            path = self.dir / f"{kind}s.csv"
            header = _csv_header(path)
            handle = open(path, "a", newline="")
            writer = csv.DictWriter(handle, fieldnames=header or list(row), extrasaction="ignore")
            if not header:
                writer.writeheader()
            self._csv[kind] = (handle, writer)
        handle, writer = self._csv[kind]
        writer.writerow(row)
        handle.flush()

    def summary(self, **values) -> dict:
        """Write summary.json (values + versions, hardware, git commit, wall time unless `values` has one) and
        return it."""
        summary = {"wall_time_s": round(time.time() - self.started, 3), **values, "versions": versions(),
                   "hardware": hardware(), "git_commit": git_commit(Path(__file__).parent)}
        self.write_json("summary.json", summary)
        return summary

    def write_json(self, name: str, value):
        """Replace OUTPUT_DIR/`name` with `value` as JSON, atomically (a reader never sees half a file)."""
        if self.active:
            tmp = self.dir / f"{name}.tmp"
            tmp.write_text(json.dumps(value, indent=2, default=str))
            os.replace(tmp, self.dir / name)

    def close(self):
        if not self.active:
            return
        self._jsonl.close()
        for handle, _ in self._csv.values():
            handle.close()


def _csv_header(path: Path) -> list[str] | None:
    """The columns of an existing CSV file's header; None for a missing or empty file."""
    try:
        with open(path, newline="") as f:
            return next(csv.reader(f), None) or None
    except FileNotFoundError:
        return None


def average_figures(metrics: dict) -> dict:
    """The weight average's test figures (--ema-decay: `evaluate` puts them under "ema"), as the records name them."""
    ema = metrics.get("ema")
    return {"ema_test_accuracy": ema["accuracy"], "ema_test_loss": ema["loss"]} if ema else {}
