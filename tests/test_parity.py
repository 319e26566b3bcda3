"""The math does not change with the world: 2 ranks x batch B end with the same parameters as
1 process x batch 2B (BatchNorm-free model, SGD with momentum, shuffled data, two epochs), with and
without gradient accumulation, under the accelerate and ddp engines."""

import pytest
import torch

from conftest import ACCELERATE, CONFIGS, PY, SCRIPTS, TORCHRUN, read_json, run
from toolkit.launcher import free_port

PARITY = SCRIPTS / "parity.py"
B = 4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("reference") / "single"
    run([PY, PARITY, "--engine", "single", "--batch-size", 2 * B, "--out", prefix])
    return prefix


def two_rank_command(engine):
    if engine == "accelerate":
        return ACCELERATE + ["--config_file", CONFIGS / "cpu.yaml"]
    return TORCHRUN + ["--master_port", free_port()]


@pytest.mark.parametrize("engine", ["accelerate", "ddp"])
def test_two_ranks_match_one_process_with_double_batch(tmp_path, reference, engine):
    prefix = tmp_path / engine
    run(two_rank_command(engine) + [PARITY, "--engine", engine, "--batch-size", B, "--out", prefix])
    for grad_accum in (1, 2):
        expected = torch.load(f"{reference}-ga{grad_accum}.pt")
        got = torch.load(f"{prefix}-ga{grad_accum}.pt")
        assert expected.keys() == got.keys()
        start = torch.nn.Linear(8, 16)  # sanity: training moved the weights at all
        assert not torch.allclose(got["0.weight"], start.weight)
        for name in expected:
            diff = (expected[name] - got[name]).abs().max().item()
            assert diff <= 1e-6, f"{engine} ga={grad_accum} {name}: max |diff| {diff:.2e}"
        # accumulate() skipped the gradient all-reduce on every non-final micro-step: one per optimizer step.
        counts = read_json(f"{prefix}-ga{grad_accum}.json")
        assert counts["optimizer_steps"] == 2 * 64 // (2 * B * grad_accum)
        assert len(counts["all_reduces"]) == counts["optimizer_steps"] and all(counts["all_reduces"])
