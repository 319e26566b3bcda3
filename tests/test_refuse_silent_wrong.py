"""Runs that would train silently wrong stop before training with one clear sentence (and never hang)."""

import re

import pytest

from conftest import ACCELERATE, CONFIGS, SCRIPTS, TORCHRUN, run
from toolkit.engines import check_world
from toolkit.errors import UserError
from toolkit.launch.env import read_launch_env
from toolkit.launch.launcher import free_port, plan_launch
from toolkit.launch.profiles import load_profile

PROBE = SCRIPTS / "probe.py"


def refusing_exit_code(text):
    """The exit code of the process that failed first, from the report of the launcher that started it:
    accelerate's simple launcher ("returned non-zero exit status N") or torchrun's root cause ("exitcode  : N";
    torchrun then stops the other ranks with SIGTERM)."""
    if "Root Cause" in text:
        text = text[text.index("Root Cause"):]
    found = re.search(r"non-zero exit status (-?\d+)|exitcode\s*:\s*(-?\d+)", text)
    return found and int(found.group(1) or found.group(2))


def assert_refused(proc, sentence):
    """The refusing process exits 2 (the README's promise); plain `accelerate launch` and `torchrun` are not
    ours and exit non-zero with their own report, which names that code. Then the guard's own sentence."""
    code = refusing_exit_code(proc.stderr)
    assert proc.returncode != 0 and code == 2, f"exit {proc.returncode}, refusing process {code}\n{proc.stderr[-3000:]}"
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert lines and sentence in lines[0], proc.stderr[-3000:]


def test_accelerate_multi_cpu_profile_that_starts_one_process(tmp_path):
    profile = tmp_path / "multi_cpu.yaml"
    profile.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                       "num_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\nuse_cpu: true\n")
    proc = run(ACCELERATE + ["--config_file", profile, PROBE, "--out", tmp_path / "x.json"], check=False, timeout=90)
    assert_refused(proc, "started only this one")
    assert not (tmp_path / "x.json").exists()


def test_accelerate_without_cpu_fix_forms_groups_of_one(tmp_path):
    """What Accelerate 1.16 does on its own on CPU: two processes, each a world of one. Caught."""
    cmd = TORCHRUN + ["--master_port", free_port(), PROBE, "--engine", "accelerate", "--accelerate-cpu-false",
                      "--out", tmp_path / "x.json"]
    proc = run(cmd, check=False, timeout=90)
    assert_refused(proc, "started 2 processes but the accelerate engine formed a group of 1")


@pytest.mark.parametrize("engine", ["single", "dp"])
def test_one_process_engine_under_torchrun(tmp_path, engine):
    cmd = TORCHRUN + ["--master_port", free_port(), PROBE, "--out", tmp_path / "x.json"]
    proc = run(cmd, check=False, timeout=90, TOOLKIT_ENGINE=engine)
    assert_refused(proc, "the dp engine runs in one process but this one was launched as rank" if engine == "dp"
                   else "started 2 processes but the single engine formed a group of 1")


class FakeEngine:
    name, device, num_processes, process_index = "ddp", "cpu", 2, 0

    def __init__(self, views):
        self.views = views

    def gather(self, _):
        import torch

        return torch.tensor(self.views)


def test_ranks_that_disagree_about_the_world():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["x.py"])
    check_world(FakeEngine([[0, 2], [1, 2]]), env)  # agreement passes
    with pytest.raises(UserError, match="disagree"):
        check_world(FakeEngine([[0, 2], [0, 2]]), env)


def test_profile_asking_for_more_gpus_than_exist():
    profile = load_profile(str(CONFIGS / "multi_gpu.yaml"))
    plan_launch(profile, "ddp", ["x.py"], gpus=2)
    with pytest.raises(UserError, match="asks for 2 processes per machine but only 1 GPU"):
        plan_launch(profile, "ddp", ["x.py"], gpus=1)
    single = load_profile(str(CONFIGS / "single_gpu.yaml"))
    with pytest.raises(UserError, match="names GPU 3 but this node has GPUs 0..1"):
        import dataclasses

        plan_launch(dataclasses.replace(single, gpu_ids="0,3"), "accelerate", ["x.py"], gpus=2)
