"""A run described by one file: every recipe takes `--config FILE` (YAML or TOML, the flags' names), flags after it
override it, `--print-config` prints the resolved settings, and the `config.yaml` a run writes into its folder,
given back as `--config`, trains the same run again: the same losses, step by step."""

import csv
import sys
from pathlib import Path

import pytest

from conftest import PY, ROOT, run
from toolkit.config import parse_config

sys.path.insert(0, str(ROOT))
from recipes.cifar import Config  # noqa: E402 (the recipe's own flags)

CIFAR = ROOT / "recipes" / "cifar.py"


def losses(out) -> list[str]:
    """The loss column of OUT/steps.csv, as written (exact text: the same run writes the same digits)."""
    with open(Path(out) / "steps.csv") as file:
        return [row["loss"] for row in csv.DictReader(file)]


def test_a_runs_config_yaml_given_back_trains_the_same_run(tmp_path):
    # Values a default would hide: a non-zero seed, an lr of its own, accumulation (global 16 in micro-batches of
    # 4), and adamw where the tiny preset has sgd.
    a, b = tmp_path / "a", tmp_path / "b"
    run([PY, CIFAR, "--dataset", "synthetic", "--model", "tiny", "--max-steps", 10, "--seed", 3, "--lr", 0.003,
         "--optimizer", "adamw", "--weight-decay", 0.01, "--global-batch-size", 16, "--micro-batch-size", 4,
         "--output-dir", a])
    written = (a / "config.yaml").read_text()
    assert "seed: 3" in written and "micro_batch_size: 4" in written and "optimizer: adamw" in written
    run([PY, CIFAR, "--config", a / "config.yaml", "--output-dir", b])
    first = losses(a)
    assert len(first) == 10 and losses(b) == first
    assert (b / "config.yaml").read_text() == written.replace(str(a), str(b))


def test_flags_after_config_override_it_and_flags_before_it_do_not(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("lr: 0.25\nseed: 7\nmicro-batch-size: auto\nsync_bn: true\n")
    after = parse_config(Config, ["--config", str(file), "--lr", "0.5", "--no-sync-bn"])
    assert (after.lr, after.seed, after.micro_batch_size, after.sync_bn) == (0.5, 7, "auto", False)
    before = parse_config(Config, ["--lr", "0.5", "--seed", "1", "--config", str(file)])
    assert (before.lr, before.seed) == (0.25, 7)
    untouched = parse_config(Config, ["--config", str(file)])
    assert untouched.epochs is None and untouched.model == "resnet18"  # what the file leaves out keeps its default


def test_print_config_writes_a_file_that_config_reads_back_in_yaml_and_toml(tmp_path):
    given = ["--dataset", "synthetic", "--model", "tiny", "--seed", "5", "--global-batch-size", "64"]
    for form in ("yaml", "toml"):
        printed = run([PY, CIFAR, *given, "--print-config", form]).stdout
        file = tmp_path / f"printed.{form}"
        file.write_text(printed)
        # the presets' values, resolved: the tiny preset's lr scaled to the global batch of 64
        assert ("lr: " if form == "yaml" else "lr = ") in printed and "null" not in printed.split("lr")[1][:8]
        again = run([PY, CIFAR, "--config", file, "--print-config"]).stdout
        assert again == printed  # --print-config without a format prints in --config's
        assert parse_config(Config, ["--config", str(file)]).seed == 5


@pytest.mark.parametrize("text, said", [
    ("lrr: 0.1\n", "unknown setting 'lrr'; did you mean lr?"),
    ("micro_batch: 4\n", "unknown setting 'micro_batch'; did you mean micro_batch_size?"),
    ("epochs: 2.5\n", "epochs: 2.5 is not an integer"),
    ("mixed_precision: no\n", "mixed_precision: False is a boolean"),  # YAML's unquoted no
    ("model: resnet99\n", "model: 'resnet99' is not one of"),
    ("keep: null\n", "keep: None is not allowed"),
    ("[1, 2]\n", "must hold a mapping"),
    ("epochs: [\n", "is not valid YAML"),
])
def test_a_bad_config_file_is_one_sentence_exit_2(tmp_path, text, said):
    file = tmp_path / "bad.yaml"
    file.write_text(text)
    proc = run([PY, CIFAR, "--config", file, "--output-dir", tmp_path / "out"], check=False, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_toml_file_and_a_missing_one_are_one_sentence_exit_2(tmp_path):
    file = tmp_path / "bad.toml"
    file.write_text("lr = \n")
    for path, said in ((file, "is not valid TOML"), (tmp_path / "none.yaml", "No such file")):
        proc = run([PY, CIFAR, "--config", path], check=False, timeout=120)
        assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
