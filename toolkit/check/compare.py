"""`toolkit compare RUN_DIR [RUN_DIR ...]`: show that runs on different topologies trained the same way.

    toolkit compare runs/python runs/accelerate runs/ddp --plot runs/compare.png

It reads what each run wrote (summary.json, steps.csv, epochs.csv), overlays their step loss and test
accuracy against images seen in one PNG, and prints one row per run: engine, processes, global batch,
micro-batch x accumulation, final accuracy, images/s, wall time, the data wait's share of the time, the largest
rank's peak memory and MFU. Runs trained with the same global batch should lie on top of each other whatever their
process counts.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError


@dataclass(frozen=True)
class RunRecord:
    path: Path
    summary: dict
    steps: list[tuple[int, float]]  # (images seen, loss) per optimizer step
    epochs: list[tuple[int, float]]  # (images seen, test accuracy) per evaluation

    @property
    def global_batch(self) -> int:
        return int(self.summary.get("global_batch_size") or self.summary["config"]["global_batch_size"])


def _rows(path: Path, value: str, global_batch: int) -> list[tuple[int, float]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [(int(row["step"]) * global_batch, float(row[value])) for row in csv.DictReader(f)]


def read_run(folder: str | Path) -> RunRecord:
    """What a recipe run wrote into `folder`; a missing folder or one without a finished run is one sentence."""
    path = Path(folder)
    if not path.is_dir():
        raise UserError(f"{path} does not exist; give the --output-dir of a finished run.")
    try:
        summary = check_summary(json.loads((path / "summary.json").read_text()), path / "summary.json")
        record = RunRecord(path, summary, [], [])
        global_batch = record.global_batch
        steps = _rows(path / "steps.csv", "loss", global_batch)
        epochs = _rows(path / "epochs.csv", "test_accuracy", global_batch)
    except FileNotFoundError:
        raise UserError(f"{path} holds no summary.json, so it is not a finished run; give the --output-dir of one.")
    except (ValueError, KeyError, TypeError, OSError) as error:  # OSError: summary.json is a folder, say
        raise UserError(f"{path} is not a run this toolkit wrote (unreadable summary.json or metrics: "
                        f"{type(error).__name__}: {error}).") from None
    return RunRecord(path, summary, steps, epochs)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_summary(summary, file: Path) -> dict:
    """`summary` if it holds the numbers the table prints; else one sentence naming the file and the key."""
    if not isinstance(summary, dict):
        raise UserError(f"{file} holds a {type(summary).__name__}, not the object a run writes; give the "
                        "--output-dir of a finished run.")
    for key, required in (("test_accuracy", True), ("images_per_s", False), ("wall_time_s", False)):
        value = summary.get(key)
        if not (_number(value) or value is None and not required):
            raise UserError(f"{file} holds {key!r} = {value!r}, not a number; give the --output-dir of a finished run.")
    return summary


def cost_cells(s: dict) -> tuple[str, str, str]:
    """(the data wait's share of the run's time, the largest rank's peak memory in GiB, MFU) from a summary; "-"
    where the run did not record it (an older toolkit's) or it is unknown.

    >>> cost_cells({"time_split_s": {"data": 1.0, "compute": 3.0, "checkpoint": 0.0}, "mfu": 0.381,
    ...             "peak_memory_bytes": {"min_rank": 1, "max_rank": 3 * 2 ** 30}})
    ('25%', '3.0', '38%')
    """
    split, peak, mfu = s.get("time_split_s"), s.get("peak_memory_bytes"), s.get("mfu")
    total = sum(v for v in split.values() if _number(v)) if isinstance(split, dict) else 0
    data = f"{split.get('data', 0) / total:.0%}" if total and _number(split.get("data")) else "-"
    memory = f"{peak['max_rank'] / 2 ** 30:.1f}" if isinstance(peak, dict) and _number(peak.get("max_rank")) else "-"
    return data, memory, f"{mfu:.0%}" if _number(mfu) else "-"


def table(runs: list[RunRecord]) -> str:
    head = ("run", "engine", "processes", "global batch", "micro x accum", "accuracy", "images/s", "wall s", "data",
            "peak GiB", "MFU")
    rows = [head]
    for run in runs:
        s = run.summary
        micro = f"{s.get('micro_batch_size', '?')} x {s.get('gradient_accumulation', '?')}"
        rows.append((str(run.path), str(s.get("engine")), str(s.get("world_size")), str(run.global_batch), micro,
                     f"{s['test_accuracy']:.4f}", f"{s.get('images_per_s') or 0:.0f}", f"{s.get('wall_time_s', 0):.1f}",
                     *cost_cells(s)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def plot(runs: list[RunRecord], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no screen needed
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        label = f"{run.path.name}: {run.summary.get('engine')} x {run.summary.get('world_size')}"
        if run.steps:
            loss_ax.plot(*zip(*run.steps), label=label, alpha=0.8, linewidth=1)
        if run.epochs:
            acc_ax.plot(*zip(*run.epochs), marker="o", label=label, alpha=0.8)
    loss_ax.set(xlabel="images seen", ylabel="step loss (mean over ranks)", title="training loss")
    acc_ax.set(xlabel="images seen", ylabel="test accuracy", title="test accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run_compare(args) -> int:
    """Entry point of `toolkit compare` (args from toolkit.cli): print the table, write the PNG."""
    runs = [read_run(folder) for folder in args.runs]
    print(table(runs))
    plot(runs, Path(args.plot))
    print(f"plot: {args.plot}")
    return 0
