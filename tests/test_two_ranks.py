"""Two ranks through every launch path a user has: each must form ONE real gloo group on this CPU
machine, and gather_for_metrics must return exactly the 9 samples of a 9-sample loader."""

import pytest

from conftest import ACCELERATE, CONFIGS, PY, SCRIPTS, TOOLKIT, TORCHRUN, read_json, run
from toolkit.launch.launcher import free_port

PROBE = SCRIPTS / "probe.py"


def check_probe(out, engine, world):
    result = read_json(out)
    assert result["engine"] == engine
    assert result["world"] == world
    assert result["rank_sum"] == sum(range(world))  # the all-reduce crossed every rank: one group
    assert sorted(result["gathered"]) == list(range(9))  # exact: no sampler padding, nothing lost
    assert result["ddp_wrapper_released"]  # else gloo's threads can abort the process at exit, 1 run in ~70


@pytest.mark.parametrize("profile", ["multi_gpu.yaml", "cpu.yaml"])
def test_accelerate_launch(tmp_path, profile):
    out = tmp_path / "probe.json"
    run(ACCELERATE + ["--config_file", CONFIGS / profile, PROBE, "--out", out])
    check_probe(out, "accelerate", 2)


@pytest.mark.parametrize("engine", ["ddp", "accelerate"])
def test_torchrun(tmp_path, engine):
    out = tmp_path / "probe.json"
    run(TORCHRUN + ["--master_port", free_port(), PROBE, "--engine", engine, "--out", out])
    check_probe(out, engine, 2)


def test_legacy_torch_distributed_launch(tmp_path):
    out = tmp_path / "probe.json"
    cmd = [PY, "-m", "torch.distributed.launch", "--nproc_per_node", "2", "--master_port", free_port(),
           PROBE, "--out", out]
    proc = run(cmd)
    check_probe(out, "ddp", 2)
    assert read_json(out)["launcher"] == "torch.distributed.launch", proc.stderr[-500:]


@pytest.mark.parametrize("engine", ["ddp", "accelerate"])
def test_toolkit_launch(tmp_path, engine):
    out = tmp_path / "probe.json"
    run(TOOLKIT + ["launch", "--config_file", CONFIGS / "multi_gpu.yaml", "--engine", engine, PROBE, "--out", out])
    check_probe(out, engine, 2)


def test_toolkit_launch_routes_multi_cpu_through_torchrun(tmp_path):
    """accelerate alone starts ONE process for a MULTI_CPU profile; toolkit launch must start two."""
    profile = tmp_path / "multi_cpu.yaml"
    profile.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                       "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n")
    out = tmp_path / "probe.json"
    run(TOOLKIT + ["launch", "--config_file", profile, PROBE, "--out", out])
    check_probe(out, "accelerate", 2)


@pytest.mark.parametrize("engine", ["dp", "single"])
def test_one_process_engines(tmp_path, engine):
    """One process whatever the profile says (plain `python` is covered by the contract tests)."""
    out = tmp_path / "probe.json"
    run(TOOLKIT + ["launch", "--config_file", CONFIGS / "multi_gpu.yaml", "--engine", engine, PROBE, "--out", out])
    check_probe(out, engine, 1)
