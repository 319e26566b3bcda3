"""`toolkit parity`: run one script under two setups for K optimizer steps and compare losses and weights.

    toolkit parity accelerate_configs/cpu.yaml accelerate_configs/cpu.yaml --engine-a single --engine-b ddp \\
        --steps 5 -- recipes/cifar.py --dataset synthetic --model tiny --max-steps 5

Each side is started by the launcher (`plan_launch` + the profile) with the script's arguments followed by
its own --args-a/--args-b (given last, they win for a flag given twice). The engines record the loss of
every optimizer step, averaged over ranks, save the unwrapped weights after step K and stop the run
(toolkit/check/capture.py); this module compares the two records.

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
from toolkit.launch.launcher import format_plan, plan_launch
from toolkit.check.capture import MODEL_FILE, PARITY_DIR, PARITY_STEPS, RECORD_FILE
from toolkit.launch.profiles import Profile, check_profile, load_profile

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
class TensorDiff:
    largest: float  # max |A - B| over every element of the tensors compared
    where: str  # the tensor holding it
    count: int  # tensors compared


@dataclass(frozen=True)
class Comparison:
    loss_diffs: list[float]
    parameters: TensorDiff
    buffers: TensorDiff
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


def _tensor_diff(a: dict, b: dict, names: list[str], tolerance: float) -> tuple[TensorDiff, bool]:
    largest, where, agree = 0.0, "-", True
    for name in names:
        wa, wb = a[name].double(), b[name].double()
        diff = (wa - wb).abs()
        agree &= bool((diff <= tolerance * (1 + wa.abs())).all())
        if diff.numel() and diff.max().item() >= largest:
            largest, where = diff.max().item(), name
    return TensorDiff(largest, where, len(names)), agree


def compare(a: Outcome, b: Outcome, tolerance: float) -> Comparison:
    """Per-step loss differences and the largest parameter and buffer differences, and whether all are within
    tolerance."""
    if a.weights.keys() != b.weights.keys() or any(a.weights[k].shape != b.weights[k].shape for k in a.weights):
        raise UserError("A and B trained different models (their weights have other names or shapes); "
                        "give both the same model arguments.")
    loss_diffs = [abs(x - y) for x, y in zip(a.record["losses"], b.record["losses"])]
    losses_agree = all(_close(x, y, tolerance) for x, y in zip(a.record["losses"], b.record["losses"]))
    buffers = set(a.record["buffers"])
    parameters, parameters_agree = _tensor_diff(a.weights, b.weights, [n for n in a.weights if n not in buffers],
                                                tolerance)
    buffers, buffers_agree = _tensor_diff(a.weights, b.weights, [n for n in a.weights if n in buffers], tolerance)
    return Comparison(loss_diffs, parameters, buffers, losses_agree and parameters_agree and buffers_agree)


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
    readers = record.get("data_parallel_size", record["world_size"])  # a mesh's tp and pp ranks read one batch
    slices = record.get("pipeline_slices", 1)
    return readers * record["replicas"] * record["batch_per_forward"] * slices * record["gradient_accumulation_steps"]


def setup_mismatches(a: dict, b: dict) -> list[str]:
    """Differences between the setups that rule out agreement by themselves (the user's to fix)."""
    notes = []
    if None not in (global_batch(a), global_batch(b)) and global_batch(a) != global_batch(b):
        notes.append(f"the global batches differ ({global_batch(a)} in A, {global_batch(b)} in B): give both the "
                     "same global batch (a script that fixes it, as recipes/cifar.py does, needs no per-side arguments).")
    if a["seed"] != b["seed"]:
        notes.append(f"the seeds differ ({a['seed']} in A, {b['seed']} in B).")
    lrs = list(zip(a["learning_rates"], b["learning_rates"]))
    step = next((i for i, (x, y) in enumerate(lrs, 1) if not _close(x, y, 1e-6)), None)
    if step is not None:
        notes.append(f"the learning rates differ from step {step} ({lrs[step - 1][0]:g} in A, "
                     f"{lrs[step - 1][1]:g} in B).")
    return notes


@dataclass(frozen=True)
class Verdict:
    headline: str
    exit_code: int
    explanation: list[str]


def judge(a: dict, b: dict, result: Comparison) -> Verdict:
    """Agree (0); differ because the setups are not equivalent (1); differ for reasons the setups explain (3);
    differ with nothing to explain it (1)."""
    if result.agree:
        return Verdict("AGREE", EXIT_AGREE, [])
    mismatches = setup_mismatches(a, b)
    reasons = expected_differences(a, b)
    if mismatches:
        return Verdict("DIFFER: the two setups are not equivalent", EXIT_UNEXPLAINED,
                       [f"setup: {note}" for note in mismatches] + [f"also: {reason}" for reason in reasons])
    if reasons:
        return Verdict("DIFFER, EXPECTED", EXIT_EXPLAINED, [f"expected: {reason}" for reason in reasons])
    hint = ("nothing in the two setups explains this difference: look for rank-dependent code, a data order that "
            "depends on the world size, or a bug in the distributed path.")
    return Verdict("DIFFER", EXIT_UNEXPLAINED, [hint])


def describe(label: str, side: Side, record: dict) -> str:
    mesh = record.get("mesh")
    readers = (f"{record['world_size']} process(es) on mesh {' x '.join(f'{d} {n}' for d, n in mesh.items())}, "
               f"{record['data_parallel_size']} reading data" if mesh else f"{record['world_size']} process(es)")
    return (f"{label}: {side.profile.path}, engine {record['engine']}, {readers} x "
            f"batch {record['batch_per_forward']} per forward"
            + (f" x {record['pipeline_slices']} pipeline slices" if record.get("pipeline_slices", 1) > 1 else "")
            + f" x {record['gradient_accumulation_steps']} micro-step(s)"
            f" = {global_batch(record)} per step, mixed precision {record['mixed_precision']}, {record['device']}")


def format_report(sides: list[Side], outcomes: list[Outcome], result: Comparison, verdict: Verdict,
                  tolerance: float) -> str:
    a, b = (o.record for o in outcomes)
    lines = [describe(side.label, side, o.record) for side, o in zip(sides, outcomes)]
    lines.append(f"{'step':>4}  {'loss A':>12}  {'loss B':>12}  {'|A-B|':>9}")
    for step, (la, lb, diff) in enumerate(zip(a["losses"], b["losses"], result.loss_diffs), 1):
        lines.append(f"{step:>4}  {la:>12.7f}  {lb:>12.7f}  {diff:>9.2e}")
    for kind, diff in (("parameters", result.parameters), ("buffers", result.buffers)):
        if diff.count:
            lines.append(f"{kind} after step {a['steps']}: max |A-B| {diff.largest:.2e} (in {diff.where}; "
                         f"{diff.count} tensors)")
    lines.append(f"verdict: {verdict.headline} (tolerance |A-B| <= {tolerance:g} x (1 + |A|) on every loss, "
                 f"parameter and buffer; exit code {verdict.exit_code})")
    return "\n".join(lines + [f"  {line}" for line in verdict.explanation])


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
    verdict = judge(outcomes[0].record, outcomes[1].record, result)
    print(format_report(sides, outcomes, result, verdict, args.tolerance))
    return verdict.exit_code
