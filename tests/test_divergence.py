"""A run that trains to nothing is loud (toolkit/train/divergence.py): a schedule too short to start at the full
lr is said at start, an evaluation that diverged or stays at chance is said once naming the likely cause, and
the run still exits 0. On the suite's real digits (PNG class folders, tests/image_folders.py): the torchvision
preset at the issue's command gets 15 steps and ends near chance with both warnings; the command docs/recipes.md
gives for small images reaches >= 0.8 with neither."""

import math

import pytest
from conftest import PY, ROOT, read_json, run
from image_folders import write_digit_folders

from toolkit.train.divergence import DivergenceWatch, chance_accuracy_bound, schedule_warning
from toolkit.train.presets import PRESETS

IMAGES = ROOT / "recipes" / "images.py"
ISSUE_COMMAND = ["--model", "resnet18", "--image-size", "32", "--epochs", "3"]  # the torchvision preset: 15 steps
# docs/recipes.md, "Your own images": torchvision's models on small images in a CPU-sized run
DOCUMENTED = ["--model", "resnet18", "--image-size", "32", "--epochs", "3", "--global-batch-size", "64",
              "--warmup", "0.1", "--augment", "none"]
WARNING = "[toolkit] warning: "


def evaluations(watch, losses_accuracies, count=297):
    """The lines `watch` says over these evaluations (the last one final)."""
    said = []
    watch.say = said.append
    for i, (loss, accuracy) in enumerate(losses_accuracies):
        watch.check({"loss": loss, "accuracy": accuracy, "count": count}, final=i == len(losses_accuracies) - 1)
    return said


def test_the_issues_diverged_run_is_one_line_naming_too_few_steps_and_the_fix():
    torchvision = PRESETS["torchvision"]
    watch = DivergenceWatch(15, torchvision.lr, torchvision.global_batch_size, torchvision.warmup, classes=10)
    said = evaluations(watch, [(603.0, 0.077), (18156.0, 0.077), (2756.0, 0.077)])  # the issue's figures
    assert len(said) == 1 and said[0].startswith(WARNING), said
    for words in ("30x the previous evaluation's 603", "at chance", "too few optimizer steps (15) for lr 0.1 at "
                  "global batch 256 with no warm-up", "--global-batch-size 64", "--warmup 0.1"):
        assert words in said[0], said[0]
    assert watch.warnings == [watch.start_warning, said[0]]  # what the run keeps for its summary


def test_a_run_that_learns_is_not_warned_about_although_its_first_evaluation_looks_diverged():
    # resnet18 at 32 px, global batch 64, 69 steps: the first evaluation (BatchNorm statistics lagging the
    # weights) at chance and 33x chance loss, then 0.74 and 0.87: measured here, seed 0.
    watch = DivergenceWatch(69, 0.025, 64, 0.1, classes=10)
    assert evaluations(watch, [(74.99, 0.111), (0.736, 0.741), (0.455, 0.865)]) == []
    assert watch.warnings == []
    overfit = DivergenceWatch(2000, 0.1, 64, 0.1, classes=10)  # a tiny loss growing tenfold is not divergence
    assert evaluations(overfit, [(0.4, 0.9), (0.002, 0.99), (0.03, 0.99)]) == []


def test_one_line_a_run_at_the_first_symptom_and_a_single_final_evaluation_at_chance_is_judged():
    watch = DivergenceWatch(5000, 0.1, 256, 0.05, classes=10)  # a long run with warm-up: the lr is blamed
    said = evaluations(watch, [(1.0, 0.7), (50.0, 0.5), (60.0, 0.4), (700.0, 0.1)])
    assert len(said) == 1 and "test loss 50 is 50x the previous evaluation's 1 and 22x chance" in said[0], said
    assert "lr 0.1 too high for global batch 256" in said[0] and watch.start_warning is None
    only = DivergenceWatch(23, 0.025, 64, 0.0, classes=10)  # --epochs 1: the first evaluation is the last
    assert len(evaluations(only, [(75.0, 0.111)])) == 1
    stuck = DivergenceWatch(69, 0.025, 64, 0.1, classes=10)  # mobilenet_v3_small at 32 px, measured: not diverged
    said = evaluations(stuck, [(2.304, 0.081), (2.306, 0.074), (2.308, 0.074)])
    assert len(said) == 1 and "test accuracy 0.074 is at chance" in said[0] and "BatchNorm" in said[0], said
    assert "too high" not in said[0] and "test loss" not in said[0]
    assert evaluations(DivergenceWatch(23, 0.025, 64, 0.0, classes=10), [(75.0, 0.111), (0.7, 0.8)]) == []
    nan = DivergenceWatch(5000, 0.1, 256, 0.05)
    assert "test loss nan is not finite" in evaluations(nan, [(math.nan, 0.1), (1.0, 0.5)])[0]


def test_chance_is_one_over_the_classes_within_three_standard_errors():
    assert chance_accuracy_bound(10, 297) == pytest.approx(0.1 + 3 * math.sqrt(0.09 / 297))
    assert chance_accuracy_bound(2, 10_000) == pytest.approx(0.515)
    assert chance_accuracy_bound(2, 30) is None and chance_accuracy_bound(1, 100) is None  # cannot tell


def test_the_start_warning_fires_for_short_runs_at_full_lr_and_not_for_the_documented_runs():
    tiny, gpt = PRESETS["tiny"], PRESETS["gpt-tiny"]
    assert "15 optimizer steps at lr 0.1 (global batch 256) with no warm-up" in schedule_warning(15, 0.1, 256, 0.0)
    assert "a warm-up of 0.2 x 4 steps" in schedule_warning(4, tiny.lr, tiny.global_batch_size, tiny.warmup)
    documented = {  # steps of each README / docs/recipes.md run, with its warm-up
        "cifar.py --dataset synthetic --model tiny --epochs 3": (5000 // 64 * 3, tiny.warmup),
        "cifar.py --dataset synthetic --model tiny --epochs 2": (5000 // 64 * 2, tiny.warmup),
        "images.py (digits) --model tiny --image-size 32 --epochs 3": (1500 // 64 * 3, tiny.warmup),
        "images.py (digits), docs/recipes.md's small-image command": (1500 // 64 * 3, 0.1),
        "images.py --data-dir data/pets --model resnet18 (3,680 images, 90 epochs)": (3680 // 256 * 90, 0.0),
        "lm.py (Genesis, 86 steps an epoch)": (86 * gpt.epochs, gpt.warmup),
    }
    fired = {run: schedule_warning(steps, 0.1, 64, warmup) for run, (steps, warmup) in documented.items()}
    assert not any(fired.values()), fired


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    return write_digit_folders(tmp_path_factory.mktemp("digits"))


def recipe_run(digits, tmp_path, args):
    proc = run([PY, IMAGES, "--data-dir", digits, *args, "--workers", 1, "--output-dir", tmp_path], timeout=300)
    lines = [line.strip() for line in proc.stdout.replace("\r", "\n").splitlines()]
    return proc, [line for line in lines if line.startswith(WARNING)], read_json(tmp_path / "summary.json")


def test_the_issues_command_warns_at_start_and_once_it_diverges_and_exits_0(digits, tmp_path):
    proc, warnings, summary = recipe_run(digits, tmp_path, ISSUE_COMMAND)
    print(f"the issue's command: test accuracy {summary['test_accuracy']:.3f}; {warnings}")
    assert proc.returncode == 0 and summary["steps"] == 15
    assert len(warnings) == 2, proc.stdout[-3000:]
    assert warnings[0].startswith(f"{WARNING}15 optimizer steps at lr 0.1 (global batch 256) with no warm-up")
    assert "too few optimizer steps (15)" in warnings[1] and "--global-batch-size 64" in warnings[1]
    assert summary["warnings"] == warnings  # kept in the run's record too


def test_the_documented_small_image_command_trains_a_torchvision_model_without_warnings(digits, tmp_path):
    proc, warnings, summary = recipe_run(digits, tmp_path, DOCUMENTED)
    print(f"docs/recipes.md's small-image command: test accuracy {summary['test_accuracy']:.3f}")
    assert summary["test_accuracy"] >= 0.8 and warnings == [] == summary["warnings"], (summary["test_accuracy"], warnings)
    assert " ".join(DOCUMENTED) in (ROOT / "docs" / "recipes.md").read_text()
