"""What every benchmark here shares: flags, interleaved timing, ratio lines, results.md and the plot.

Every script measures both sides of each ratio in the same run, in rounds: one round times every side
once, in an order rotated from round to round, and a ratio is the median over rounds of the two sides'
times in that round. Pairing within a round cancels slow drift (another job starting on a shared
machine, thermal limits) that would bias two separate runs.

    >>> import time
    >>> times = time_interleaved({"a": lambda: time.sleep(0.01), "b": lambda: time.sleep(0.02)}, rounds=3)
    >>> round(paired_ratio(times, "a", over="b"))   # a is twice as fast as b
    2
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import UserError, report
from toolkit.train.records import git_commit

ROOT = Path(__file__).resolve().parent.parent


def build_parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes: --quick and --out (default benchmarks/out/<name>)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, a few seconds: exercises the code, the numbers are rough")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / name,
                        help="folder for results.md and the plot (default: %(default)s)")
    return parser


def run_main(main: Callable[[], int]) -> None:
    """Run a benchmark's main(): a mistake the user can fix is one line on stderr and exit code 2."""
    try:
        code = main()
    except UserError as error:
        code = report(error)
    sys.exit(code)


def prepare_out(out: Path) -> Path:
    """Create `out` and check matplotlib is there, before minutes of measuring rather than after."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("the benchmarks draw their plot with matplotlib, which is not installed; "
                        "pip install matplotlib.")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"cannot create the output folder {out} ({error.strerror}); pass a writable --out.") from None
    return out


# ----------------------------------------------------------------------------------------------- timing

def time_interleaved(sides: dict[str, Callable[[], object]], rounds: int,
                     sync: Callable[[], object] = lambda: None) -> dict[str, list[float]]:
    """Call every side once per round (rotating the order) and return each side's seconds per round.
    `sync` runs before each clock read: torch.cuda.synchronize on a GPU, a barrier across ranks."""
    names, times = list(sides), {name: [] for name in sides}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            sync()
            start = time.perf_counter()
            sides[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(times: dict[str, list[float]], side: str, over: str) -> float:
    """Throughput of `side` divided by throughput of `over` (same work per call): the median over
    rounds of over's time / side's time, each pair measured in the same round."""
    return statistics.median(t_over / t_side for t_side, t_over in zip(times[side], times[over]))


def best_ratio(times: dict[str, list[float]], side: str, over: str) -> float:
    """Like paired_ratio but from each side's fastest round: the least disturbed one on a busy machine."""
    return min(times[over]) / min(times[side])


def ratio_spread(times: dict[str, list[float]], side: str, over: str) -> tuple[float, float]:
    """The lower and upper quartile of the per-round ratios behind paired_ratio's median: how far one
    round's ratio strays, so a reader sees whether a target lies inside the noise."""
    ratios = [t_over / t_side for t_side, t_over in zip(times[side], times[over])]
    if len(ratios) < 2:
        return ratios[0], ratios[0]
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive")
    return quartiles[0], quartiles[2]


def median_interval(times: dict[str, list[float]], side: str, over: str) -> tuple[float, float]:
    """A distribution-free ~95% interval for the median of the per-round ratios (order statistics: the k-th
    smallest and k-th largest, k from the binomial(n, 1/2) tail), so a verdict can tell a ratio that clears
    its target from one whose target lies inside the round-to-round noise. With fewer than 6 rounds no such
    interval exists at 95%: the whole range is returned."""
    ratios = sorted(t_over / t_side for t_side, t_over in zip(times[side], times[over]))
    n, k, tail = len(ratios), 0, 0.0
    while n and tail + math.comb(n, k) / 2 ** n <= 0.025:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)  # 1-based order statistic: k=1 is the whole range
    return ratios[k - 1], ratios[n - k]


def per_second(items: float, seconds: list[float]) -> float:
    """Items per second at the median time of a call that handles `items` items."""
    return items / statistics.median(seconds)


def calls_for(step: Callable[[], object], block_s: float, sync: Callable[[], object] = lambda: None,
              min_calls: int = 1) -> int:
    """How many calls of `step` fill about `block_s` seconds (timed on two calls after one warm-up), and at
    least `min_calls`: a block of one slow call is one noisy sample, not a measurement."""
    return max(min_calls, round(block_s / seconds_per_call(step, sync)))


def seconds_per_call(step: Callable[[], object], sync: Callable[[], object] = lambda: None) -> float:
    step()
    sync()
    start = time.perf_counter()
    step()
    step()
    sync()
    return max((time.perf_counter() - start) / 2, 1e-9)


# ----------------------------------------------------------------------------------------------- ratios

@dataclass(frozen=True)
class Ratio:
    """One reported ratio; `target` is the least value that passes (None: reported only). With `interval` (a
    median's ~95% interval over timed rounds) the verdict is PASS or MISS only when the whole interval is on
    one side of the target, else WITHIN NOISE: a re-run can then not turn a PASS into a MISS by chance."""

    name: str
    value: float
    target: float | None = None
    interval: tuple[float, float] | None = None

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        if self.interval is not None and self.interval[0] < self.target <= self.interval[1]:
            return "WITHIN NOISE"
        if self.interval is not None:
            return "PASS" if self.interval[0] >= self.target else "MISS"
        return "PASS" if self.value >= self.target else "MISS"

    def line(self) -> str:
        """`ratio NAME: 0.991 (target >= 0.98: PASS)`, the line tests and readers look for."""
        goal = f" (target >= {self.target:g}: {self.verdict})" if self.target is not None else ""
        if self.interval is not None:
            goal += f" [95% interval of the median {self.interval[0]:.3f}-{self.interval[1]:.3f}]"
        return f"ratio {self.name}: {self.value:.3f}{goal}"


def exit_code(ratios: list[Ratio], quick: bool) -> int:
    """0, or 1 when a full run missed a target (--quick measures, it never fails on speed)."""
    missed = [r.name for r in ratios if r.verdict == "MISS"]
    if missed and not quick:
        print(f"missed target: {', '.join(missed)}", file=sys.stderr)
        return 1
    unsettled = [r.name for r in ratios if r.verdict == "WITHIN NOISE"]
    if unsettled and not quick:
        print(f"within noise (more --rounds or a quieter machine would settle them): {', '.join(unsettled)}",
              file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- reports

def machine_line() -> str:
    """CPUs, load, torch/accelerate versions and GPUs: the context a number needs."""
    import torch

    load = " / ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) or "no GPU"
    return (f"{platform.machine()}, {os.cpu_count()} CPUs (load average {load} at the end), {gpus}; "
            f"python {platform.python_version()}, torch {torch.__version__}, accelerate {_version('accelerate')}")


def _version(package: str) -> str:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "not installed"


def markdown_table(columns: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return str(value)


def write_results(out: Path, title: str, columns: list[str], rows: list[list[object]], ratios: list[Ratio],
                  notes: list[str], plot: str) -> Path:
    """results.md: the command, the machine, the table, the ratio lines and the notes."""
    command = " ".join(["python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    commit = (git_commit(ROOT) or "unknown")[:10]
    measured = f"Measured {time.strftime('%Y-%m-%d %H:%M')} at commit {commit} on {machine_line()}."
    text = [f"# {title}", "", f"Command: `{command}`  ", measured, "", markdown_table(columns, rows), ""]
    text += [f"- `{r.line()}`" for r in ratios]
    text += [f"- {note}" for note in notes]
    text += ["", f"![{title}]({plot})", ""]
    path = out / "results.md"
    path.write_text("\n".join(text))
    return path


@dataclass(frozen=True)
class Bars:
    """What the plot shows: one horizontal bar per label, `marks` written at the bar ends."""

    labels: list[str]
    values: list[float]
    xlabel: str
    marks: list[str]


def plot_bars(path: Path, title: str, bars: Bars) -> Path:
    """A horizontal bar chart as a PNG (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * len(bars.labels) + 1.4))
    drawn = ax.barh(range(len(bars.labels)), bars.values, color="tab:blue")
    ax.set_yticks(range(len(bars.labels)), bars.labels)
    ax.invert_yaxis()  # first label on top, as in the table
    ax.set_xlabel(bars.xlabel)
    ax.set_title(title)
    for bar, mark in zip(drawn, bars.marks):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {mark}", va="center", fontsize=8)
    ax.set_xlim(0, max(bars.values, default=1) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def publish(out: Path, name: str, title: str, table: tuple[list[str], list[list[object]]], ratios: list[Ratio],
            notes: list[str], bars: Bars) -> None:
    """Print the table, ratio lines and notes, then write results.md and <name>.png into `out`."""
    columns, rows = table
    print(markdown_table(columns, rows))
    for ratio in ratios:
        print(ratio.line())
    for note in notes:
        print(f"note: {note}")
    plot = plot_bars(out / f"{name}.png", title, bars)
    results = write_results(out, title, columns, rows, ratios, notes, plot.name)
    print(f"wrote {results} and {plot}")
