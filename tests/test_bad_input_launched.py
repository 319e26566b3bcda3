"""Every recipe, data and checkpoint case of tests/test_bad_input.py under a real 2-process launch: plain
`accelerate launch` (cpu.yaml, the accelerate engine) and `toolkit launch --engine ddp` (quiet torchrun).

One launch per launcher runs all cases on the same two ranks (tests/scripts/bad_input_cases.py): each case
through the recipe's `main`, its failure said as an uncaught one is said, and the last case (the README's
missing data folder) left uncaught so that the ranks and the launcher end for real. What must hold:
- every case is said in exactly one line across both ranks, and every rank of every case stops with a
  user error (the one that said it) or a quiet peer failure with the same exit code 2: none went on,
  none crashed, none timed out;
- no Python traceback from our processes; `toolkit launch` prints nothing but its notes and the final
  sentence and exits 2; accelerate launch exits non-zero with our sentence as the root cause of its summary.
The same cases run in one process in tests/test_bad_input.py; the launch-specific error paths (a rank-local
failure, torchrun, python) are in tests/test_errors_under_launchers.py.
"""

import json

import pytest

import toolkit
from conftest import ACCELERATE, CONFIGS, SCRIPTS, TOOLKIT, run
from test_bad_input import RECIPE_CASES, cifar
from toolkit.errors import UserError
from toolkit.train.config import check_config
from toolkit.train.presets import apply_preset

CPU = str(CONFIGS / "cpu.yaml")
LAUNCHERS = {
    "accelerate launch": ACCELERATE + ["--config_file", CPU],
    "toolkit launch": TOOLKIT + ["launch", "--config_file", CPU, "--engine", "ddp"],
}
LAST = "missing data folder"  # the README's example, left uncaught by the driver
# --timeout 30 first (a case may set its own): a rank left waiting for a peer fails within 30 s, not 300.
BASE = ["--dataset", "synthetic", "--model", "tiny", "--timeout", "30"]
# 63 images do not split over 2 processes at all (another guard, also in the table): the micro-batch guard
# with 2 processes needs a global batch they share evenly.
TWO_RANKS = {"global batch that does not split": (
    lambda t: ["--global-batch-size", "62", "--micro-batch-size", "4"],
    "--micro-batch-size 4 does not divide the 31 images each of the 2 process(es)")}


def fails_before_the_group(argv) -> bool:
    """Whether the recipe refuses these flags before it builds its engine (no process group yet)."""
    try:
        check_config(apply_preset(toolkit.parse_config(cifar.Config, argv))[0])
    except (UserError, SystemExit):
        return True
    return False


def build_cases(tmp_path, capsys):
    """[(name, argv, words)], the cases that fail before the process group first (as they would in a fresh
    launch), then the others, then the missing data folder."""
    cases = []
    for number, name in enumerate(sorted(RECIPE_CASES)):
        folder = tmp_path / f"case-{number}"
        folder.mkdir()
        flags, words = TWO_RANKS.get(name, RECIPE_CASES[name])
        argv = BASE + ["--output-dir", str(folder / "out"), *flags(folder)]
        cases.append((name, argv, words(folder) if callable(words) else words))
    capsys.readouterr()  # what the in-process probe below printed is not the launch's
    early = {name for name, argv, _ in cases if fails_before_the_group(argv)}
    capsys.readouterr()
    cases.sort(key=lambda case: case[0] not in early)
    missing = tmp_path / "nonexistent"
    cases.append((LAST, ["--dataset", "cifar10", "--data-dir", str(missing), "--output-dir", str(tmp_path / "o")],
                  f"cifar10 was not found in {missing}"))
    return cases, early


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_every_recipe_case_under_a_two_process_launch(launcher, tmp_path, capsys):
    cases, early = build_cases(tmp_path, capsys)
    (tmp_path / "cases.json").write_text(json.dumps([{"name": n, "argv": a} for n, a, _ in cases]))
    proc = run(LAUNCHERS[launcher] + [SCRIPTS / "bad_input_cases.py", tmp_path / "cases.json", tmp_path],
               check=False, timeout=300)
    output = proc.stdout + proc.stderr
    assert all((tmp_path / f"rank-{r}.json").exists() for r in (0, 1)), output  # both reached the last case
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    lines = error_lines(output)
    for name, _, words in cases:
        # A line per case (counted below); some guards say one sentence for several flags (--lr, --timeout).
        assert any(words in line for line in lines), f"{name}: {words!r} not said\n{output}"
        if name == LAST:
            continue
        outcomes = [rank[name] for rank in ranks]
        assert all(o["kind"] in ("UserError", "PeerFailure", "SystemExit") and o["code"] == 2 for o in outcomes), \
            f"{name}: {outcomes}"
        assert sum(o["said"] for o in outcomes) == 1, f"{name}: {outcomes}"
        assert outcomes[0]["group_formed"] == (name not in early), f"{name}: {outcomes}"
        assert not (tmp_path / f"case-{sorted(RECIPE_CASES).index(name)}" / "out" / "summary.json").exists()
    assert len(lines) == len(cases) and "not reached" not in output and "[rank" not in output, output
    if launcher == "toolkit launch":
        assert proc.returncode == 2 and "Traceback" not in output, output
        assert [line for line in output.splitlines() if not line.startswith("[toolkit]")] == lines, output
    else:  # accelerate's own summary (and its own traceback) follow; our last sentence is its root cause
        assert proc.returncode != 0 and output.count("Traceback") <= 1, output
        assert f"traceback : {lines[-1]}" in output.split("Root Cause")[1], output
    assert len(early) >= 10 and len(cases) - 1 - len(early) >= 8, early  # both kinds well represented
    print(f"{launcher}: {len(cases)} cases ({len(early)} before the process group) in one launch, "
          f"exit code {proc.returncode}")
