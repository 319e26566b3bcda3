"""Startup: wall seconds from a command's start to its first optimizer step, as ratios to bare torchrun.

    python benchmarks/startup.py                # 7 sides x 5 rounds, about 4 minutes on 2 idle CPU cores
    python benchmarks/startup.py --quick        # 1 round, `torchrun recipe` and `toolkit launch ddp` left out
    python benchmarks/startup.py --rounds 9     # more rounds: a narrower interval around each median

Every side is a fresh command started here (clock read with time.time() right before subprocess.Popen)
that trains the recipe's `--dataset synthetic --model tiny` run or its hand-written reference,
benchmarks/bare_step.py (plain PyTorch, no toolkit import: the same layers, the same amount of synthetic
data, one SGD step on the same micro-batch). Its time to first step is the first optimizer step's Unix time,
written by the main process, minus that clock: the recipe's `summary.json` `attempts[0].first_step_at`, the
bare script's --out file.
- `torchrun bare`:     python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bare_step.py --out F
- `toolkit launch`:    toolkit launch --config_file accelerate_configs/cpu.yaml recipes/cifar.py ARGS
- `toolkit launch ddp`: the same with --engine ddp (the toolkit's own engine instead of Accelerate's default)
- `accelerate launch`: accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar.py ARGS
- `torchrun recipe`:   python -m torch.distributed.run --standalone --nproc-per-node 2 recipes/cifar.py ARGS
- `python recipe`:     python recipes/cifar.py ARGS
- `python bare`:       python benchmarks/bare_step.py --out F
where ARGS is `--dataset synthetic --model tiny --max-steps 2 --output-dir DIR` (a fresh DIR per launch). The
launchers are 2 gloo ranks on the CPU; `toolkit` and `accelerate` are the console scripts installed next to
this python (not a pyenv or conda shim in front of them). Each round launches every side once, in an order
rotated from round to round. Targets, on the median over rounds of the per-round ratio of times (lower is
better): toolkit launch (either engine) / torchrun bare <= 1.2 and python recipe / python bare <= 1.2; a full
run exits 1 when one misses, --quick never does. A launch that fails or records no first step stops the run with exit
code 1 and its last lines of stderr (all of it kept in --out). Every command runs to its end (step 2, a
checkpoint, one evaluation): that is most of the run's time, but not of the figures.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import common

from toolkit.errors import RunFailure, UserError, report

TARGET = 1.2  # a side's seconds to first step over its reference's, at most
ROUNDS = 5
LAUNCH_TIMEOUT_S = 300
RECIPE, BARE, PROFILE = "recipes/cifar.py", "benchmarks/bare_step.py", "accelerate_configs/cpu.yaml"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# side -> the side its ratio divides by, and the target (None: reported only)
REFERENCES = {"toolkit launch": ("torchrun bare", TARGET), "toolkit launch ddp": ("torchrun bare", TARGET),
              "accelerate launch": ("torchrun bare", None),
              "torchrun recipe": ("torchrun bare", None), "python recipe": ("python bare", TARGET)}
# Variables a launcher leaves behind would make a child think it is a rank of some other job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TOOLKIT_ENGINE", "ACCELERATE_MIXED_PRECISION",
               "ACCELERATE_USE_CPU")


@dataclass(frozen=True)
class AtMost(common.Ratio):
    """A ratio of times, lower is better: `target` is the most that passes (common.Ratio's is the least).
    Judged like common.Ratio on the median's interval: WITHIN NOISE while the target lies inside it."""

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        low, high = self.interval or (self.value, self.value)
        if low <= self.target < high:
            return "WITHIN NOISE"
        return "PASS" if high <= self.target else "MISS"

    def line(self) -> str:
        goal = f" (target <= {self.target:g}: {self.verdict})" if self.target is not None else ""
        if self.interval is not None:
            goal += f" [95% interval of the median {self.interval[0]:.3f}-{self.interval[1]:.3f}]"
        return f"ratio {self.name}: {self.value:.3f}{goal}"


@dataclass(frozen=True)
class Launch:
    first_step_s: float  # command start to the first optimizer step done
    main_rank_s: float | None  # the main rank's own start to that step (the summary's time_to_first_step_s)
    engine: str


def parse_args(argv=None):
    parser = common.build_parser("startup", __doc__)
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"launches of every side (default {ROUNDS}; --quick 1)")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else ROUNDS
    if args.rounds < 1:
        raise UserError(f"--rounds must be at least 1, not {args.rounds}.")
    return args


def console_script(name: str) -> str:
    """The `name` command installed with this python; a shim on PATH would add its own start-up to one side."""
    found = shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)
    if found is None:
        raise UserError(f"the `{name}` command is not installed for {sys.executable}; pip install -e . there.")
    return found


def side_commands(quick: bool) -> dict:
    """side -> a function of a fresh folder giving (its command, where its first step's time is written)."""
    def recipe(*launcher):
        return lambda tmp: ([*launcher, RECIPE, "--dataset", "synthetic", "--model", "tiny", "--max-steps", "2",
                             "--output-dir", str(tmp / "run")], tmp / "run" / "summary.json")

    def bare(*launcher):
        return lambda tmp: ([*launcher, BARE, "--out", str(tmp / "first_step.json")], tmp / "first_step.json")

    sides = {"torchrun bare": bare(*TORCHRUN),
             "toolkit launch": recipe(console_script("toolkit"), "launch", "--config_file", PROFILE),
             "toolkit launch ddp": recipe(console_script("toolkit"), "launch", "--config_file", PROFILE, "--engine",
                                         "ddp"),
             "accelerate launch": recipe(console_script("accelerate"), "launch", "--config_file", PROFILE),
             "torchrun recipe": recipe(*TORCHRUN), "python recipe": recipe(sys.executable),
             "python bare": bare(sys.executable)}
    if quick:  # the launcher's share shows without them; it saves two launches
        del sides["torchrun recipe"], sides["toolkit launch ddp"]
    return sides


def launch(side: str, command: list[str], written: Path, tmp: Path, out: Path) -> Launch:
    """Run one command to its end; its first optimizer step's time from the clock read just before it started.
    A failed launch leaves its whole stderr in `out`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    with open(tmp / "stdout", "w") as stdout, open(tmp / "stderr", "w") as stderr:
        t0 = time.time()
        proc = subprocess.Popen(command, cwd=common.ROOT, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            code = proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = f"none: stopped after {LAUNCH_TIMEOUT_S} s"
    record = json.loads(written.read_text()) if written.is_file() else {}
    first_step_at = (record["attempts"][0] if record.get("attempts") else record).get("first_step_at")
    if code != 0 or not isinstance(first_step_at, (int, float)):
        log = shutil.copy(tmp / "stderr", out / f"failed-{side.replace(' ', '-')}.stderr")
        tail = Path(log).read_text(errors="replace").splitlines()[-15:]
        why = f"exit code {code}" if code != 0 else f"no first_step_at in {written.name}"
        raise RunFailure(f"side `{side}` failed ({why}): {' '.join(command)}\nits stderr ends (all of it in {log}):\n"
                         + "\n".join(f"    {line}" for line in tail))
    engine = f"{record['engine']} x {record['world_size']}" if "engine" in record else "plain torch"
    main_rank_s = record.get("time_to_first_step_s")
    return Launch(first_step_at - t0, main_rank_s, engine)


def stop(proc: subprocess.Popen):
    """Kill a hung launch and the ranks it started (torchrun gives each a session of its own)."""
    try:
        import psutil

        family = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil missing, or the process already gone
        family = []
    for process in family:
        try:
            process.kill()
        except Exception:
            pass
    proc.kill()
    proc.wait()


def measure(sides: dict, rounds: int, out: Path):
    """Every side launched once per round, in common.time_interleaved's rotated order. Returns each side's
    Launch per round and the seconds each whole command took (first step, then the rest of the run and exit)."""
    launches = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="startup-") as root:
        def runner(side):
            def run_once():
                tmp = Path(tempfile.mkdtemp(dir=root))
                command, written = sides[side](tmp)
                launches[side].append(launch(side, command, written, tmp, out))
                shutil.rmtree(tmp, ignore_errors=True)
                print(f"round {len(launches[side])}: {side}: first step after {launches[side][-1].first_step_s:.2f} s",
                      flush=True)
            return run_once

        whole = common.time_interleaved({side: runner(side) for side in sides}, rounds)
    return launches, whole


def seconds(values: list[float]) -> str:
    """The median to 10 ms ("" for none); -0.00 from rounding shows as 0.00."""
    return f"{statistics.median(values) + 0.0:.2f}".replace("-0.00", "0.00") if values else ""


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    sides = side_commands(args.quick)
    try:
        launches, whole = measure(sides, args.rounds, out)
    except RunFailure as error:
        return report(error)
    times = {side: [launch.first_step_s for launch in runs] for side, runs in launches.items()}
    rows, ratios = [], []
    for side, runs in launches.items():
        reference, target = REFERENCES.get(side, (None, None))
        ratio = None
        if reference:
            ratio = AtMost(f"{side} / {reference}", common.paired_ratio(times, reference, over=side), target,
                           common.median_interval(times, reference, side))
            ratios.append(ratio)
        main_rank = [run.main_rank_s for run in runs if run.main_rank_s is not None]
        before = [run.first_step_s - run.main_rank_s for run in runs if run.main_rank_s is not None]
        rows.append([side, runs[0].engine, f"{statistics.median(times[side]):.2f}", f"{min(times[side]):.2f}",
                     seconds(main_rank), seconds(before), seconds(whole[side]),
                     f"{ratio.value:.3f}" if ratio else "(reference)", reference or "",
                     f"<= {target:g}" if target else "", ratio.verdict if ratio else ""])
    notes = [
        f"{args.rounds} round(s); seconds are medians over rounds, from the clock read just before the command "
        "started to its first optimizer step done (written by the main process).",
        ("main rank: the recipe summary's time_to_first_step_s (the main rank's own process start to that step); "
         "before it: what starts first (launcher, agent, rendezvous)."),
        "whole run: the command start to its exit (the recipe goes on with step 2, a checkpoint and one evaluation).",
        ("ratios are the median over rounds of a side's seconds over its reference's in the same round; a target "
         "is judged on the ~95% interval of that median (with fewer than 6 rounds, the whole range): PASS or MISS "
         "only when all of it is on one side, else WITHIN NOISE."),
    ]
    columns = ["side", "engine x processes", "to first step s (median)", "min s",
               "main rank: own start to first step s", "before the main rank s", "whole run s",
               "÷ reference (median)", "reference", "target", "result"]
    marks = [f"{r[2]} s" + (f", {r[7]}x {r[8]}" if r[8] else "") for r in rows]
    bars = common.Bars([r[0] for r in rows], [float(r[2]) for r in rows],
                       "seconds from the command's start to its first optimizer step (median)", marks)
    common.publish(out, "startup", "Startup: seconds from the command's start to the first optimizer step",
                   (columns, rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


if __name__ == "__main__":
    common.run_main(main)
