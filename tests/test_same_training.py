"""Same training on every topology: the global batch is the recipe's unit, so `python`, 2 accelerate ranks
and 2 ddp ranks train the same model from the same command line; the presets train real data; the README's
main command trains stably; `toolkit compare` shows it.

The learning checks use real images (scikit-learn's handwritten digits in the CIFAR layout, tests/digits.py)
and the tiny preset's defaults: only dataset, data folder, epochs, output folder and augmentation are given.
"""

import csv
import re
import shlex

import pytest
from conftest import ACCELERATE, CONFIGS, PY, ROOT, TOOLKIT, TORCHRUN, read_json, run
from digits import write_digits_cifar

from toolkit.train.batching import plan_batches
from toolkit.errors import UserError
from toolkit.launch.launcher import free_port
from toolkit.train.presets import PRESETS, apply_preset

CIFAR = ROOT / "recipes" / "cifar.py"
# An SVM reaches ~0.99 on the digits; the tiny preset measured 0.963-0.987 over seeds 0-2 in one process.
DIGITS_BAR = 0.95
# What the design guarantees and what rounding alone does, measured on these three runs under three kernel paths
# (ATEN_CPU_CAPABILITY=default; avx2 with MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2, as on an AVX2-only
# AMD EPYC; native avx512), python and 2 ddp ranks, on one machine:
# - the same samples in the same global batches: every step's loss of the first epoch (23 steps) within 4.8e-7 of
#   every other run's, 2 float32 units at 2.3, on every path. FIRST_EPOCH_ATOL is 20 times that; a sample seen
#   twice or a batch split differently moves a loss by 1e-2.
# - then the rounding differences grow (1e-6 by step 30, 2e-3 by step 45, 0.65 by step 69) until the runs are
#   as far apart as two kernel paths of one process: test accuracies python 0.956 / 0.963 / 0.966 (avx2 / avx512 /
#   default), so rounding alone moves one process's accuracy by 0.010 (3 of 297 images); ddp 0.976 / 0.970 / 0.973;
#   0.020 between the launchers at most (python 0.956 against ddp 0.976 on avx2). SAME_WITHIN is 3 times the
#   one-process rounding spread.
FIRST_EPOCH_ATOL, SAME_WITHIN = 1e-5, 0.03
STEPS_PER_EPOCH = 1500 // 64


# ----------------------------------------------------------------------------- the batch plan and presets

def test_the_global_batch_splits_over_processes_and_micro_batches():
    assert [(p.processes, p.micro_batch, p.accumulation) for p in
            (plan_batches(64, 1), plan_batches(64, 2), plan_batches(64, 8), plan_batches(64, 1, 16),
             plan_batches(64, 2, 8))] == [(1, 64, 1), (2, 32, 1), (8, 8, 1), (1, 16, 4), (2, 8, 4)]
    assert str(plan_batches(64, 2, 16)) == "64 = 2 process(es) x micro-batch 16 x accumulation 2"


def test_a_global_batch_that_does_not_divide_is_one_sentence_naming_what_would():
    with pytest.raises(UserError) as raised:
        plan_batches(100, 3)
    assert str(raised.value) == ("--global-batch-size 100 does not split evenly over 3 processes; launch 1, 2, 4, 5, "
                                 "10, 20, 25, 50 process(es), or with 3 use a multiple of 3 such as 99 or 102.")
    with pytest.raises(UserError) as raised:
        plan_batches(64, 2, 12)
    assert str(raised.value) == ("--micro-batch-size 12 does not divide the 32 images each of the 2 process(es) "
                                 "computes per optimizer step (global batch 64); use one of 1, 2, 4, 8, 16, 32.")


def test_presets_fill_what_flags_leave_unset_and_scale_lr_linearly_with_the_global_batch():
    from recipes.cifar import Config

    tiny = PRESETS["tiny"]
    cfg, rule = apply_preset(Config(model="tiny"))
    assert (cfg.global_batch_size, cfg.lr, cfg.epochs, cfg.weight_decay) == (64, 0.04, 15, 5e-4)
    assert rule == "sgd, linear schedule; lr from the tiny preset"
    scaled, rule = apply_preset(Config(model="tiny", global_batch_size=256))
    assert scaled.lr == pytest.approx(tiny.lr * 256 / 64) and scaled.epochs == tiny.epochs
    assert rule == "sgd, linear schedule; lr 0.16 = 0.04 x 256/64, linear scaling (Goyal et al. 2017)"
    flagged, rule = apply_preset(Config(model="resnet9", global_batch_size=256, lr=0.3, epochs=2))
    assert (flagged.lr, flagged.epochs, rule) == (0.3, 2, "sgd, linear schedule; lr from --lr")
    # Another optimizer than the preset's brings its own lr, weight decay and schedule; the warm-up stays the preset's.
    adamw, rule = apply_preset(Config(model="resnet9", optimizer="adamw", global_batch_size=1024))
    assert (adamw.lr, adamw.weight_decay, adamw.schedule, adamw.warmup) == (1e-3, 0.05, "cosine", PRESETS["resnet9"].warmup)
    assert rule == "adamw, cosine schedule; lr 0.001 = 0.0005 x 1024/512, linear scaling (Goyal et al. 2017)"
    assert apply_preset(Config(model="resnet9", optimizer="adamw", schedule="constant"))[0].schedule == "constant"
    assert apply_preset(Config(model="resnet18"))[0].global_batch_size == PRESETS["resnet18"].global_batch_size


# ----------------------------------------------------------------------------- real digits, three launchers

@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """The tiny preset on the digits under python, 2 accelerate ranks and 2 ddp ranks: one command line."""
    root = tmp_path_factory.mktemp("digits")
    data = write_digits_cifar(root / "data")
    recipe = [CIFAR, "--dataset", "cifar10", "--data-dir", data, "--epochs", 15, "--augment", "crop", "--model", "tiny"]
    launchers = {"python": [PY], "accelerate": ACCELERATE + ["--config_file", CONFIGS / "cpu.yaml"],
                 "ddp": TORCHRUN + ["--master_port", free_port()]}
    runs = {}
    for name, launcher in launchers.items():
        out = root / name
        proc = run(launcher + recipe + ["--output-dir", out], timeout=300)
        runs[name] = (out, proc, read_json(out / "summary.json"))
    return runs


def step_losses(out) -> list[float]:
    with open(out / "steps.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def test_digits_train_the_same_steps_under_every_launcher_and_agree_within_rounding(digits_runs):
    """The same global batches of the same samples: the first epoch's losses agree to rounding. After it the
    rounding differences grow as in any one process on another kernel path, so the final accuracies each reach the
    bar and agree within the spread that rounding alone gives (FIRST_EPOCH_ATOL, SAME_WITHIN: measured above)."""
    accuracies = {name: summary["test_accuracy"] for name, (_, _, summary) in digits_runs.items()}
    losses = {name: step_losses(out) for name, (out, _, _) in digits_runs.items()}
    first_epoch = max(abs(a - b) for run in losses.values() for a, b in zip(run[:STEPS_PER_EPOCH],
                                                                            losses["python"][:STEPS_PER_EPOCH]))
    print(f"digits, tiny preset, 15 epochs: {accuracies}; first epoch's losses within {first_epoch:.1e}")
    for name, (_, proc, summary) in digits_runs.items():
        processes = 1 if name == "python" else 2
        assert (summary["world_size"], summary["global_batch_size"], summary["test_count"]) == (processes, 64, 297)
        assert summary["steps"] == len(losses[name]) == 15 * STEPS_PER_EPOCH  # the same steps whatever the world
        assert f"global batch 64 = {processes} process(es) x micro-batch {64 // processes} x accumulation 1" in proc.stdout
    assert first_epoch <= FIRST_EPOCH_ATOL, first_epoch
    assert all(acc >= DIGITS_BAR for acc in accuracies.values()), accuracies
    assert max(accuracies.values()) - min(accuracies.values()) <= SAME_WITHIN, accuracies


def test_toolkit_compare_tabulates_and_plots_the_runs(digits_runs, tmp_path):
    folders = [out for out, _, _ in digits_runs.values()]
    plot = tmp_path / "compare.png"
    proc = run(TOOLKIT + ["compare", *folders, "--plot", plot])
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["run", "engine", "processes", "global", "batch", "micro", "x", "accum", "accuracy",
                                "images/s", "wall", "s", "data", "peak", "GiB", "MFU"]
    for (out, _, summary), line in zip(digits_runs.values(), lines[1:4]):
        cells = re.split(r"\s{2,}", line)
        assert cells[:5] == [str(out), summary["engine"], str(summary["world_size"]), "64",
                             f"{summary['micro_batch_size']} x 1"], line
        assert cells[5] == f"{summary['test_accuracy']:.4f}"
        split = summary["time_split_s"]
        assert cells[8:] == [f"{split['data'] / sum(split.values()):.0%}",
                             f"{summary['peak_memory_bytes']['max_rank'] / 2 ** 30:.1f}", "-"], line  # MFU: a CPU
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_toolkit_compare_refuses_a_folder_that_is_not_a_run(tmp_path):
    proc = run(TOOLKIT + ["compare", tmp_path], check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: {tmp_path} holds no summary.json, so it is not a finished run; give the --output-dir of one.")
    proc = run(TOOLKIT + ["compare", tmp_path / "missing"], check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr


# ----------------------------------------------------------------------------- the README's main command

def readme_main_command() -> list[str]:
    """The README's first command, after its `pip install ... &&`: the main job exactly as a user runs it."""
    text = (ROOT / "README.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("pip install -e . && "))
    return shlex.split(line.split(" && ", 1)[1])


def test_readme_main_command_trains_stably_to_the_bar(tmp_path):
    command = readme_main_command()
    assert command[:2] == ["accelerate", "launch"] and "--output-dir" in command
    # Run where the README says, from a folder that holds the repository's profiles and recipes, so that its
    # relative paths (and its runs/ output) resolve as they do for a user, without touching the checkout.
    for name in ("accelerate_configs", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    run(ACCELERATE + command[2:], cwd=tmp_path, timeout=300)
    out = tmp_path / command[command.index("--output-dir") + 1]
    summary = read_json(out / "summary.json")
    with open(out / "steps.csv") as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    warmup = max(1, int(len(losses) * PRESETS["tiny"].warmup))
    print(f"README main command: accuracy {summary['test_accuracy']}, largest loss after warm-up "
          f"{max(losses[warmup:]) / losses[0]:.2f} x the first")
    assert summary["world_size"] == 2 and summary["test_accuracy"] >= 0.85
    assert max(losses[warmup:]) <= 1.5 * losses[0]
