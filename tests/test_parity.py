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


def test_sync_bn_on_cpu_ranks_averages_running_stats(tmp_path):
    prefix = tmp_path / "bn"
    cmd = TORCHRUN + ["--master_port", free_port(), SCRIPTS / "syncbn.py", prefix]
    proc = run(cmd, TOOLKIT_ENGINE="ddp")
    assert proc.stdout.count("SyncBatchNorm needs GPUs") == 1  # said once, by the main process
    ranks = [torch.load(f"{prefix}-rank{r}.pt") for r in (0, 1)]
    assert not torch.equal(ranks[0]["before"], ranks[1]["before"])  # ranks diverged while training
    assert torch.equal(ranks[0]["mean"], ranks[1]["mean"]) and torch.equal(ranks[0]["var"], ranks[1]["var"])
