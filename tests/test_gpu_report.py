"""The plumbing of scripts/gpu_report.sh on a machine without a GPU: it refuses in one sentence, and every
command it would run takes the flags it passes. No GPU figure is produced or checked here."""

import importlib
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, clean_env

import toolkit

SCRIPT = ROOT / "scripts" / "gpu_report.sh"


def test_refuses_in_one_sentence_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the refusal cannot happen here")
    proc = subprocess.run(["bash", SCRIPT, tmp_path / "r.md"], capture_output=True, text=True, cwd=ROOT,
                          env=clean_env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "no CUDA device" in proc.stderr and not (tmp_path / "r.md").exists()


def test_every_step_takes_the_flags_it_is_given(monkeypatch):
    steps = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=60,
                           env=clean_env(GPU_REPORT_DRY_RUN="1"), check=True).stdout.splitlines()
    assert len(steps) == 4 and "-m gpu" in steps[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flags are checked, nothing runs
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    recipe = shlex.split(steps[3].split("&&")[0])
    assert recipe[3] == "recipes/cifar.py" and "scripts/cost_lines.py" in steps[3]
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    cfg = toolkit.parse_config(importlib.import_module("cifar").Config, recipe[4:])
    assert (cfg.model, cfg.mixed_precision, cfg.profile_steps) == ("resnet18", "bf16", "60:65")
    for step in steps[1:3]:
        words = shlex.split(step)
        script = next(w for w in words if w.endswith(".py"))
        module = importlib.import_module(script.split("/")[-1][:-3])
        args = module.parse_args(words[words.index(script) + 1:])
        assert args.device == "cuda", step
    assert sys.executable
