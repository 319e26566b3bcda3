"""`toolkit env`: versions, devices, engine and topology for every shipped profile, and the mismatches it
sees before a launch (a busy port, fp16 on CPU, MULTI_CPU without mpirun, a shadowing default config,
launch variables left by a parent job)."""

import json
import socket

import accelerate.commands.config.config_args as accelerate_config
import pytest
import torch
from conftest import CONFIGS, LAUNCH_VARS, TOOLKIT, run

from toolkit import cli
from toolkit.check.env import collect

KEYS = {"versions", "devices", "launch_environment", "profile", "toolkit_launch", "accelerate_default_config",
        "findings"}
TOPOLOGY = {  # profile: machines, processes per machine, world size, mixed precision, address
    "cpu.yaml": (1, 2, 2, "no", "127.0.0.1:a free port picked at launch"),
    "fsdp.yaml": (1, 2, 2, "bf16", "127.0.0.1:a free port picked at launch"),
    "single_gpu.yaml": (1, 1, 1, "bf16", None),
    "multi_gpu.yaml": (1, 2, 2, "bf16", "127.0.0.1:a free port picked at launch"),
    "multi_node.yaml": (2, 2, 4, "bf16", "10.0.0.1:29500"),
}
# What `toolkit env` must find on a machine without GPUs, written here rather than read from the report: bf16
# runs on CPU (not an error), a GPU profile runs on CPU with a warning, and multi_node.yaml names 10.0.0.1 as
# machine 0's address, which is not this host: an error, exit 1.
WITHOUT_GPUS = {  # profile: (exit code, [(severity, code) of each finding])
    "cpu.yaml": (0, []),
    "single_gpu.yaml": (0, [("warning", "no-gpu")]),  # asks for a GPU this machine lacks (issue 12)
    "fsdp.yaml": (0, [("warning", "no-gpu"), ("warning", "fsdp-without-cuda")]),  # runs the toolkit's fsdp engine
    "multi_gpu.yaml": (0, [("warning", "no-gpu")]),
    "multi_node.yaml": (1, [("warning", "no-gpu"), ("error", "main-address-not-here")]),
}


@pytest.fixture
def clean_shell(monkeypatch, tmp_path):
    """This process as a fresh shell: no launch variables, no accelerate default config."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(accelerate_config, "default_config_file", str(tmp_path / "default_config.yaml"))


def toolkit_env(capsys, *args):
    code = cli.main(["env", *map(str, args)])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(TOPOLOGY))
def test_every_shipped_profile(clean_shell, capsys, name):
    machines, per_machine, world, precision, address = TOPOLOGY[name]
    code, out = toolkit_env(capsys, "--config_file", CONFIGS / name, "--json")
    report = json.loads(out)
    assert set(report) == KEYS
    profile = report["profile"]
    assert (profile["num_machines"], profile["processes_per_machine"], profile["world_size"]) == (machines, per_machine, world)
    assert profile["mixed_precision"] == precision and profile["source"] == "--config_file"
    assert report["versions"]["accelerate"] and report["versions"]["toolkit"]
    assert report["devices"]["cpus"] >= 1 and len(report["devices"]["gpus"]) == torch.cuda.device_count()
    assert report["launch_environment"]["auto_engine"] == "single"  # plain python here
    assert report["toolkit_launch"]["engine"] == "accelerate"
    if not torch.cuda.is_available():
        assert (code, [(f["severity"], f["code"]) for f in report["findings"]]) == WITHOUT_GPUS[name]
    elif name in ("cpu.yaml", "multi_node.yaml"):  # these two do not depend on the GPUs
        assert code == WITHOUT_GPUS[name][0]

    human_code, human = toolkit_env(capsys, "--config_file", CONFIGS / name)
    assert human_code == code
    assert f"{machines} machine(s) x {per_machine} process(es) = world size {world}" in human
    assert f"precision  {precision}" in human and "engine `auto` picks single" in human
    assert (f"rendezvous static at {address}" if address else "rendezvous none (one process)") in human
    for finding in report["findings"]:
        assert f"{finding['severity']}: {finding['message']}" in human


def test_a_gpu_profile_on_a_machine_without_gpus_says_where_it_runs(clean_shell, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    report = json.loads(toolkit_env(capsys, "--config_file", CONFIGS / "multi_gpu.yaml", "--json")[1])
    assert report["profile"]["device"] == "cpu" and report["profile"]["backend"] == "gloo"
    assert [f["code"] for f in report["findings"]] == ["no-gpu"]


def test_mismatches_stop_with_exit_1(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        profile = tmp_path / "mismatch.yaml"
        profile.write_text((CONFIGS / "cpu.yaml").read_text()
                           .replace("distributed_type: MULTI_GPU", "distributed_type: MULTI_CPU")
                           .replace("main_process_port: 0 ", f"main_process_port: {port} ")
                           .replace("mixed_precision: 'no'", "mixed_precision: fp16"))
        proc = run(TOOLKIT + ["env", "--config_file", profile, "--json"], check=False, HF_HOME=tmp_path)
    assert proc.returncode == 1, proc.stderr
    findings = {f["code"]: f["message"] for f in json.loads(proc.stdout)["findings"]}
    assert findings["port-in-use"] == (f"port {port} on 127.0.0.1 is already in use; set another main_process_port "
                                       "or 0 for a free one.")
    assert findings["fp16-on-cpu"].startswith("fp16 mixed precision needs a CUDA device")
    assert "starts ONE" in findings["multi-cpu-without-mpirun"]


def test_shadowing_default_config_and_leftover_launch_variables(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text((CONFIGS / "multi_gpu.yaml").read_text())
    proc = run(TOOLKIT + ["env", "--config_file", CONFIGS / "cpu.yaml"], HF_HOME=tmp_path, RANK=1, WORLD_SIZE=2,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    out = proc.stdout
    assert "launch env   torchrun, rank 1 of 2: engine `auto` picks ddp (launched by torchrun)" in out
    assert f"reads {tmp_path / 'accelerate' / 'default_config.yaml'} (MULTI_GPU, 2 process(es)" in out
    assert "not " + str(CONFIGS / "cpu.yaml") in out and "[default-config-shadows]" in out
    assert "RANK=1, WORLD_SIZE=2, MASTER_ADDR=127.0.0.1, MASTER_PORT=29500 already set here" in out


def test_without_config_file_it_describes_accelerates_default_config(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "accelerate" / "default_config.yaml").write_text((CONFIGS / "multi_node.yaml").read_text())
    proc = run(TOOLKIT + ["env", "--json"], check=False, HF_HOME=tmp_path)
    profile = json.loads(proc.stdout)["profile"]
    assert profile["source"] == "accelerate default config" and profile["world_size"] == 4


def test_inside_srun_the_topology_comes_from_slurm(clean_shell):
    srun = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2", "SLURM_NODEID": "0",
            "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.1"}
    report = collect(str(CONFIGS / "cpu.yaml"), environ=srun)
    assert (report["launch_environment"]["launcher"], report["launch_environment"]["auto_engine"]) == ("slurm", "ddp")
    profile = report["profile"]
    assert (profile["num_machines"], profile["world_size"], profile["main_process_ip"]) == (2, 4, "127.0.0.1")
    assert report["findings"] == [] and "SLURM job 7" in report["toolkit_launch"]["notes"][0]


def test_bad_profile_is_one_line_and_exit_2(tmp_path):
    proc = run(TOOLKIT + ["env", "--config_file", tmp_path / "missing.yaml"], check=False)
    assert proc.returncode == 2
    expected = f"error: no accelerate profile at {tmp_path / 'missing.yaml'}; see accelerate_configs/ for the shipped ones."
    assert proc.stderr.strip().splitlines() == [expected]
