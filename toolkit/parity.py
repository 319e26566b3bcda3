"""`toolkit parity`: run one script under two setups for K optimizer steps and compare losses and weights.

    toolkit parity accelerate_configs/cpu.yaml accelerate_configs/cpu.yaml --engine-a single --engine-b ddp \\
        --args-a="--batch-size 8" --args-b="--batch-size 4" --steps 5 \\
        -- recipes/cifar.py --dataset synthetic --model tiny --max-steps 5

Each side is started by the launcher (`plan_launch` + the profile) with the script's arguments followed by
its own --args-a/--args-b (given last, they win for a flag given twice). The engines record the loss of
every optimizer step, averaged over ranks, save the unwrapped weights after step K and stop the run
(toolkit/parity_capture.py); this module compares the two records.

Exit codes: 0 the runs agree within the tolerance; 3 they differ and the setups explain why (BatchNorm
over different per-process batches, mixed precision, dropout, TF32); 1 they differ and nothing explains
it; 2 a usage error.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import RunFailure, UserError, report
from toolkit.launcher import format_plan, plan_launch
from toolkit.parity_capture import MODEL_FILE, PARITY_DIR, PARITY_STEPS, RECORD_FILE
from toolkit.profiles import Profile, check_profile, load_profile

EXIT_AGREE, EXIT_UNEXPLAINED, EXIT_EXPLAINED = 0, 1, 3
LOG_TAIL_LINES = 20


@dataclass(frozen=True)
class Side:
    """One of the two setups: a profile, an engine and the arguments only this side gets."""

    label: str  # "A" or "B"
    profile: Profile
    engine: str
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    """What a side's run recorded: `record` as parity_capture wrote it, and the final weights."""

    record: dict
    weights: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Comparison:
    loss_diffs: list[float]
    weight_diff: float
    worst_weight: str
    agree: bool


def build_side(label: str, config: str, engine: str, num_processes: int | None, extra: str) -> Side:
    """A side from its command-line pieces, e.g. `build_side("A", "accelerate_configs/cpu.yaml", "ddp", 1, "")`."""
    profile = load_profile(config)
    if num_processes is not None:
        profile = dataclasses.replace(profile, num_processes=num_processes)
        check_profile(profile)
    try:
        extra_args = tuple(shlex.split(extra))
    except ValueError as error:
        raise UserError(f"--args-{label.lower()} {extra!r} is not a valid argument string ({error}).") from None
    return Side(label, profile, engine, extra_args)


def run_side(side: Side, script_and_args: list[str], folder: Path, steps: int) -> Outcome:
    """Launch `side` with parity capture on, its output going to FOLDER/output.log; read what it recorded."""
    folder.mkdir(parents=True, exist_ok=True)
    plan = plan_launch(side.profile, side.engine, list(script_and_args) + list(side.extra_args))
    plan = dataclasses.replace(plan, env={**plan.env, PARITY_DIR: str(folder), PARITY_STEPS: str(steps)})
    print(f"[toolkit] parity: running {side.label}: {format_plan(plan)}", file=sys.stderr, flush=True)
    log = folder / "output.log"
    with open(log, "w") as out:
        code = subprocess.run(plan.command, check=False, env={**os.environ, **plan.env}, stdout=out,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        _print_tail(log)
        kind = UserError if code == 2 else RunFailure
        raise kind(f"run {side.label} exited with code {code} before step {steps}; its output ends above.")
    return read_outcome(side, folder, steps)


def _print_tail(log: Path):
    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
    print("\n".join(f"  | {line}" for line in lines), file=sys.stderr)


def read_outcome(side: Side, folder: Path, steps: int) -> Outcome:
    from safetensors.torch import load_file

    record_path = folder / RECORD_FILE
    if not record_path.is_file():
        raise UserError(f"run {side.label} made no optimizer step the toolkit could see: the script must build its "
                        "engine with toolkit.build_accelerator() and step an optimizer it prepared.")
    record = json.loads(record_path.read_text())
    if record["steps"] < steps:
        raise UserError(f"run {side.label} ended after {record['steps']} of the {steps} optimizer steps asked for; "
                        "lower --steps or let the script train longer.")
    weights = {}
    for index in range(len(list(folder.glob(MODEL_FILE.format(index="*"))))):
        for name, tensor in load_file(folder / MODEL_FILE.format(index=index)).items():
            weights[f"model{index}.{name}" if index else name] = tensor
    return Outcome(record, weights)


def _close(a: float, b: float, tolerance: float) -> bool:
    return abs(a - b) <= tolerance * (1 + abs(a))


def compare(a: Outcome, b: Outcome, tolerance: float) -> Comparison:
    """Per-step loss differences and the largest weight difference, and whether all are within tolerance."""
    if a.weights.keys() != b.weights.keys() or any(a.weights[k].shape != b.weights[k].shape for k in a.weights):
        raise UserError("A and B trained different models (their weights have other names or shapes); "
                        "give both the same model arguments.")
    loss_diffs = [abs(x - y) for x, y in zip(a.record["losses"], b.record["losses"])]
    losses_agree = all(_close(x, y, tolerance) for x, y in zip(a.record["losses"], b.record["losses"]))
    weight_diff, worst, weights_agree = 0.0, "-", True
    for name, wa in a.weights.items():
        wa, wb = wa.double(), b.weights[name].double()
        diff = (wa - wb).abs()
        weights_agree &= bool((diff <= tolerance * (1 + wa.abs())).all())
        if diff.numel() and diff.max().item() >= weight_diff:
            weight_diff, worst = diff.max().item(), name
    return Comparison(loss_diffs, weight_diff, worst, losses_agree and weights_agree)


def expected_differences(a: dict, b: dict) -> list[str]:
    """Why two records may legitimately differ; empty when nothing in the setups explains a difference."""
    reasons = []
    batchnorm = max(a.get("batchnorm", 0), b.get("batchnorm", 0))
    split_differs = (a["batch_per_forward"], a["world_size"]) != (b["batch_per_forward"], b["world_size"])
    if batchnorm and (a["batch_per_forward"] != b["batch_per_forward"] or a["batch_per_forward"] is None
                      and split_differs):
        reasons.append(
            f"BatchNorm without sync: {batchnorm} layer(s) normalise over the batch each forward sees, "
            f"{a['batch_per_forward']} samples in A and {b['batch_per_forward']} in B, so the statistics and the "
            "gradients differ (compare equal per-process batches, a BatchNorm-free model, or SyncBatchNorm on GPUs).")
    precisions = {a["mixed_precision"], b["mixed_precision"]} - {"no"}
    if precisions:
        reasons.append(
            f"mixed precision (A {a['mixed_precision']}, B {b['mixed_precision']}): {'/'.join(sorted(precisions))} "
            "rounds every matmul, and a different split of the batch rounds differently (compare with "
            "mixed_precision 'no').")
    if a.get("dropout") or b.get("dropout"):
        reasons.append(
            "dropout in train mode: each process draws its own masks from its own seed (seed + rank), so the "
            "masks differ between setups (compare with p=0).")
    if a.get("tf32") or b.get("tf32"):
        reasons.append(
            "TF32 on CUDA: matmuls/convolutions round inputs to 10 mantissa bits and pick kernels by batch size "
            "(set torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False to compare).")
    return reasons


def global_batch(record: dict) -> int | None:
    if record["batch_per_forward"] is None:
        return None
    return record["world_size"] * record["replicas"] * record["batch_per_forward"] * record["gradient_accumulation_steps"]


def setup_mismatches(a: dict, b: dict) -> list[str]:
    """Differences between the setups that rule out agreement by themselves (the user's to fix)."""
    notes = []
    if global_batch(a) != global_batch(b):
        notes.append(f"the global batches differ ({global_batch(a)} in A, {global_batch(b)} in B): give the sides "
                     "per-process batches that multiply out to the same number with --args-a/--args-b.")
    if a["seed"] != b["seed"]:
        notes.append(f"the seeds differ ({a['seed']} in A, {b['seed']} in B).")
    lrs = list(zip(a["learning_rates"], b["learning_rates"]))
    step = next((i for i, (x, y) in enumerate(lrs, 1) if not _close(x, y, 1e-6)), None)
    if step is not None:
        notes.append(f"the learning rates differ from step {step} ({lrs[step - 1][0]:g} in A, "
                     f"{lrs[step - 1][1]:g} in B).")
    return notes


def describe(label: str, side: Side, record: dict) -> str:
    return (f"{label}: {side.profile.path}, engine {record['engine']}, {record['world_size']} process(es) x "
            f"batch {record['batch_per_forward']} per forward x {record['gradient_accumulation_steps']} micro-step(s)"
            f" = {global_batch(record)} per step, mixed precision {record['mixed_precision']}, {record['device']}")


def format_report(sides: list[Side], outcomes: list[Outcome], result: Comparison, reasons: list[str],
                  tolerance: float) -> str:
    a, b = (o.record for o in outcomes)
    lines = [describe(side.label, side, o.record) for side, o in zip(sides, outcomes)]
    lines.append(f"{'step':>4}  {'loss A':>12}  {'loss B':>12}  {'|A-B|':>9}")
    for step, (la, lb, diff) in enumerate(zip(a["losses"], b["losses"], result.loss_diffs), 1):
        lines.append(f"{step:>4}  {la:>12.7f}  {lb:>12.7f}  {diff:>9.2e}")
    lines.append(f"weights after step {a['steps']}: max |A-B| {result.weight_diff:.2e} (in {result.worst_weight}; "
                 f"{len(outcomes[0].weights)} parameter and buffer tensors)")
    rule = f"tolerance |A-B| <= {tolerance:g} x (1 + |A|) on every loss and every weight"
    if result.agree:
        lines.append(f"verdict: AGREE ({rule})")
        return "\n".join(lines)
    lines.append(f"verdict: {'DIFFER, EXPECTED' if reasons else 'DIFFER'} ({rule})")
    lines += [f"  expected: {reason}" for reason in reasons]
    lines += [f"  setup: {note}" for note in setup_mismatches(a, b)]
    if not reasons:
        lines.append("  nothing in the two setups explains this difference: look for rank-dependent code, "
                     "data order or a bug in the distributed path.")
    return "\n".join(lines)


def run_parity(args) -> int:
    """Entry point of `toolkit parity` (args from `toolkit.cli`); returns the exit code described above."""
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, not {args.steps}.")
    if not args.tolerance >= 0:
        raise UserError(f"--tolerance must be zero or positive, not {args.tolerance}.")
    if not args.script:
        raise UserError("no script given: toolkit parity A.yaml B.yaml [options] -- script.py [args ...].")
    if not os.path.isfile(args.script[0]):
        raise UserError(f"no script at {args.script[0]}.")
    sides = [build_side("A", args.config_a, args.engine_a, args.num_processes_a, args.args_a),
             build_side("B", args.config_b, args.engine_b, args.num_processes_b, args.args_b)]
    with tempfile.TemporaryDirectory(prefix="toolkit-parity-") as scratch:
        root = Path(args.output_dir or scratch)
        try:
            outcomes = [run_side(side, args.script, root / side.label.lower(), args.steps) for side in sides]
        except RunFailure as error:  # a run crashed (exit 1), or stopped on a user error (exit 2)
            return report(error)
    result = compare(*outcomes, args.tolerance)
    reasons = [] if result.agree else expected_differences(outcomes[0].record, outcomes[1].record)
    print(format_report(sides, outcomes, result, reasons, args.tolerance))
    if result.agree:
        return EXIT_AGREE
    return EXIT_EXPLAINED if reasons else EXIT_UNEXPLAINED
