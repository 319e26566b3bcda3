"""`toolkit parity`: two setups of one script, run for K steps by real launchers, agree when the math says they
must (1 process x 2B vs 2 ranks x B; accelerate vs ddp), differ with the reason named when it says they may
not (BatchNorm over different per-process batches), and fail when nothing explains a difference."""

import json

import pytest
from conftest import CONFIGS, ROOT, SCRIPTS, TOOLKIT, run

from toolkit import cli
from toolkit.check.parity import Comparison, TensorDiff, expected_differences, judge

CPU = CONFIGS / "cpu.yaml"
TARGET = SCRIPTS / "parity_target.py"
CIFAR = ROOT / "recipes" / "cifar.py"


def parity(*args, check_code):
    proc = run(TOOLKIT + ["parity", *args], check=False, timeout=240)
    assert proc.returncode == check_code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc


# One command line for both sides: the recipe's global batch (the tiny preset's 64) is the unit, so the
# launcher only decides where it is computed.
RECIPE = ["--", CIFAR, "--dataset", "synthetic", "--model", "tiny", "--max-steps", "4"]


@pytest.mark.parametrize("engine_b, options_b, split_b", [
    ("accelerate", [], (2, 32, 1)),
    ("ddp", [], (2, 32, 1)),
    # The memory loader augments by epoch position, so 4 micro-batches of 16 hold exactly the images (and
    # crops and flips) of the whole batch of 64.
    ("single", ["--args-b=--micro-batch-size 16"], (1, 16, 4)),
])
def test_recipe_under_python_agrees_with_every_split_of_its_global_batch(tmp_path, engine_b, options_b, split_b):
    proc = parity(CPU, CPU, "--engine-a", "single", "--engine-b", engine_b, "--steps", "4", *options_b,
                  "--output-dir", tmp_path / "parity", *RECIPE, "--output-dir", tmp_path / "run", check_code=0)
    assert "verdict: AGREE" in proc.stdout
    a, b = (json.loads((tmp_path / "parity" / side / "record.json").read_text()) for side in "ab")
    assert (a["world_size"], a["batch_per_forward"], a["gradient_accumulation_steps"]) == (1, 64, 1)
    assert (b["world_size"], b["batch_per_forward"], b["gradient_accumulation_steps"]) == split_b
    assert len(a["losses"]) == len(b["losses"]) == 4
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-5
    assert a["learning_rates"] == b["learning_rates"] and a["learning_rates"][-1] > 0  # training really moved


def test_accelerate_agrees_with_ddp():
    proc = parity(CPU, CPU, "--engine-a", "accelerate", "--engine-b", "ddp", "--steps", "3",
                  "--", TARGET, "--batch-size", "4", check_code=0)
    assert "engine accelerate, 2 process(es)" in proc.stdout and "engine ddp, 2 process(es)" in proc.stdout
    assert "verdict: AGREE" in proc.stdout


def test_batchnorm_over_different_per_process_batches_is_an_expected_difference():
    proc = parity(CPU, CPU, "--engine-a", "single", "--engine-b", "ddp", "--steps", "3",
                  "--args-a=--batch-size 8", "--args-b=--batch-size 4", "--", TARGET, "--layer", "batchnorm",
                  check_code=3)
    assert "verdict: DIFFER, EXPECTED" in proc.stdout
    assert "BatchNorm without sync: 1 layer(s)" in proc.stdout and "8 samples in A and 4 in B" in proc.stdout


def test_a_difference_nothing_explains_fails():
    proc = parity(CPU, CPU, "--engine-a", "single", "--engine-b", "ddp", "--steps", "2", "--args-a=--batch-size 8",
                  "--args-b=--batch-size 4", "--", TARGET, "--bug-data-per-rank", check_code=1)
    assert "verdict: DIFFER (" in proc.stdout and "nothing in the two setups explains" in proc.stdout
    assert "   1     " in proc.stdout  # the per-step table is there


@pytest.mark.parametrize("args, message", [
    (["nope.yaml", CPU, "--", TARGET], "no accelerate profile at nope.yaml"),
    ([CPU, CPU, "--steps", "0", "--", TARGET], "--steps must be at least 1"),
    ([CPU, CPU, "--", "missing.py"], "no script at missing.py"),
    ([CPU, CPU, "--steps", "2", TARGET], "put `--` between"),
    ([CPU, CPU, "--args-a=--lr '0.1", "--", TARGET], "is not a valid argument string"),
])
def test_usage_errors_are_one_sentence_and_exit_2(capsys, args, message):
    try:
        code = cli.main(["parity", *map(str, args)])
    except SystemExit as parse_error:  # argparse's own errors
        code = parse_error.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    ([SCRIPTS / "parity_noop.py"], "made no optimizer step"),
    ([TARGET, "--epochs", "1"], "ended after 8 of the 50 optimizer steps"),
])
def test_a_run_that_does_not_reach_step_k_is_a_usage_error(args, message):
    proc = parity(CPU, CPU, "--engine-a", "single", "--steps", "50", "--", *args, check_code=2)
    assert message in proc.stderr and "Traceback" not in proc.stderr


def record(**overrides):
    base = {"engine": "ddp", "world_size": 2, "replicas": 1, "batch_per_forward": 4, "mixed_precision": "no",
            "gradient_accumulation_steps": 1, "batchnorm": 0, "dropout": 0, "tf32": False, "seed": 0,
            "learning_rates": [0.1, 0.1]}
    return {**base, **overrides}


@pytest.mark.parametrize("a, b, reason", [
    (record(), record(engine="accelerate"), None),
    (record(batchnorm=2), record(batchnorm=2, engine="accelerate"), None),  # same split: BatchNorm agrees
    (record(batchnorm=2, world_size=1, batch_per_forward=8), record(batchnorm=2), "BatchNorm without sync"),
    (record(mixed_precision="bf16"), record(), "mixed precision (A bf16, B no)"),
    (record(), record(dropout=1), "dropout in train mode"),
    (record(tf32=True), record(tf32=True), "TF32 on CUDA"),
])
def test_which_setups_explain_a_difference(a, b, reason):
    reasons = expected_differences(a, b)
    assert reasons == [] if reason is None else any(r.startswith(reason) for r in reasons), reasons


DIFFERENT = Comparison([0.5], TensorDiff(0.1, "w", 1), TensorDiff(0.0, "-", 0), agree=False)


@pytest.mark.parametrize("b, headline, code, line", [
    (record(engine="accelerate"), "DIFFER", 1, "nothing in the two setups explains"),
    (record(batch_per_forward=8), "DIFFER: the two setups are not equivalent", 1, "setup: the global batches differ (8 in A, 16 in B)"),
    (record(learning_rates=[0.1, 0.3]), "DIFFER: the two setups are not equivalent", 1,
     "setup: the learning rates differ from step 2 (0.1 in A, 0.3 in B)"),
    (record(dropout=1), "DIFFER, EXPECTED", 3, "expected: dropout in train mode"),
])
def test_verdicts(b, headline, code, line):
    verdict = judge(record(), b, DIFFERENT)
    assert (verdict.headline, verdict.exit_code) == (headline, code)
    assert any(text.startswith(line) for text in verdict.explanation), verdict.explanation
