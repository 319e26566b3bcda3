"""The launch environment is read in one place, and every shipped profile loads with accelerate's parser."""

import dataclasses

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from conftest import CONFIGS, TOOLKIT, run

from toolkit.engines import resolve_engine
from toolkit.errors import UserError
from toolkit.launch.env import first_slurm_host, read_launch_env
from toolkit.launch.launcher import plan_launch
from toolkit.launch.topology import slurm_overrides
from toolkit.launch.profiles import load_profile

TORCHRUN_ENV = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x"}
CASES = {
    "python": ({}, [], ("python", 0, 0, 1, 0), "single"),
    "torchrun": (TORCHRUN_ENV, [], ("torchrun", 3, 1, 4, 1), "ddp"),
    "accelerate": ({**TORCHRUN_ENV, "ACCELERATE_MIXED_PRECISION": "bf16"}, [], ("accelerate", 3, 1, 4, 1), "accelerate"),
    "legacy": ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, ["--local-rank=1"],
               ("torch.distributed.launch", 1, 1, 2, 0), "ddp"),
    "legacy_underscore": ({"RANK": "0", "WORLD_SIZE": "2"}, ["--local_rank", "0"],
                          ("torch.distributed.launch", 0, 0, 2, 0), "ddp"),
    "slurm": ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
               "SLURM_STEP_ID": "0", "SLURM_NTASKS_PER_NODE": "2(x4)", "SLURM_NODELIST": "gpu[03-06]"}, [],
              ("slurm", 5, 1, 8, 2), "ddp"),
    "mpi": ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, [],
            ("mpi", 1, 1, 2, 0), "ddp"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_launch_env(case):
    environ, extra_argv, expected, auto_engine = CASES[case]
    env = read_launch_env(environ, ["train.py", *extra_argv])
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank) == expected
    assert env.device == "cpu"
    assert resolve_engine("auto", env) == auto_engine
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.rank = 0  # read once, never mutated


def test_slurm_first_host_and_engine_precedence():
    assert first_slurm_host("gpu[03-05,09],cpu1") == "gpu03"
    assert read_launch_env(CASES["slurm"][0], ["x"]).master_addr == "gpu03"
    env = read_launch_env({**TORCHRUN_ENV, "TOOLKIT_ENGINE": "accelerate"}, ["x"])
    assert resolve_engine("auto", env) == "accelerate"  # TOOLKIT_ENGINE beats the launcher
    assert resolve_engine("dp", env) == "dp"  # an explicit argument beats both
    with pytest.raises(UserError, match="unknown engine"):
        resolve_engine("horovod", env)


def test_accelerate_simple_launcher_that_lost_processes_is_noticed():
    env = read_launch_env({"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, ["x"])
    assert env.launcher == "accelerate" and env.accelerate_lost_processes
    # a world of one that torchrun started (accelerate launch --num_processes 1 via its torchrun path) is not lost
    one = read_launch_env({"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, ["x"])
    assert not one.accelerate_lost_processes


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_profile_loads_with_accelerates_parser(path):
    config = load_config_from_file(str(path))  # raises on any key accelerate does not know
    profile = load_profile(str(path))
    assert profile.num_processes == config.num_processes >= 1
    text = path.read_text()
    keys = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert all("#" in line for line in keys), "every key carries a comment"


def test_launch_plans():
    multi_gpu = load_profile(str(CONFIGS / "multi_gpu.yaml"))
    ddp = plan_launch(multi_gpu, "ddp", ["train.py", "--lr", "1"], gpus=2)
    assert ddp.command[1:3] == ["-m", "torch.distributed.run"] and ddp.env["TOOLKIT_ENGINE"] == "ddp"
    assert ddp.command[ddp.command.index("--nproc_per_node") + 1] == "2"
    assert ddp.command[ddp.command.index("--master_addr") + 1] == "127.0.0.1"
    assert ddp.command[-3:] == ["train.py", "--lr", "1"]
    node = load_profile(str(CONFIGS / "multi_node.yaml"))
    node1 = plan_launch(dataclasses.replace(node, machine_rank=1), "ddp", ["t.py"], gpus=2)
    assert node1.command[node1.command.index("--nnodes") + 1] == "2"
    assert node1.command[node1.command.index("--node_rank") + 1] == "1"
    assert node1.command[node1.command.index("--master_addr") + 1] == "10.0.0.1"
    c10d = plan_launch(dataclasses.replace(node, rdzv_backend="c10d"), "ddp", ["t.py"], gpus=2)
    assert c10d.command[c10d.command.index("--rdzv_endpoint") + 1] == "10.0.0.1:29500"
    # c10d numbers the nodes itself; who hosts the store is said outright, not guessed from the host name
    assert "--node_rank" not in c10d.command and c10d.command[c10d.command.index("--rdzv_conf") + 1] == "is_host=1"
    elastic = plan_launch(dataclasses.replace(node, rdzv_backend="c10d"), "ddp", ["t.py"], gpus=2, max_restarts=3,
                          min_nodes=1, last_call_s=2, join_timeout_s=60, keep_alive_s=1)
    assert elastic.command[elastic.command.index("--nnodes") + 1] == "1:2"
    assert elastic.command[elastic.command.index("--rdzv_conf") + 1] == \
        "is_host=1,join_timeout=60,last_call_timeout=2,keep_alive_interval=1"
    with pytest.raises(UserError, match="the single engine runs on one machine"):
        plan_launch(node, "single", ["t.py"], gpus=2)
    ids = plan_launch(dataclasses.replace(multi_gpu, gpu_ids="1,0"), "accelerate", ["t.py"], gpus=2)
    assert ids.env["CUDA_VISIBLE_DEVICES"] == "1,0" and "accelerate.commands.launch" in ids.command
    assert plan_launch(multi_gpu, "dp", ["t.py"], gpus=2).command[1:] == ["t.py"]


SLURM_STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NODEID": "1",
              "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2",
              "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]"}


def test_slurm_decides_the_topology_inside_srun():
    node = load_profile(str(CONFIGS / "multi_node.yaml"))
    overrides, notes = slurm_overrides(node, read_launch_env(SLURM_STEP, argv=[]))
    assert overrides == {"num_machines": 2, "machine_rank": 1, "main_process_ip": "gpu07", "main_process_port": 29500,
                         "num_processes": 4}
    assert notes == ["SLURM job 4242: node 1 of 2, 2 process(es) per node, main node gpu07:29500."]
    three = {**SLURM_STEP, "SLURM_NNODES": "3", "SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[07-09]"}
    no_port = dataclasses.replace(node, main_process_port=None)
    assert slurm_overrides(no_port, read_launch_env(three, argv=[]))[0]["main_process_port"] == 20000 + 4242
    with pytest.raises(UserError, match="srun started 2 tasks on this node"):
        slurm_overrides(node, read_launch_env({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "1,2"}, argv=[]))
    # The job asked for 2 tasks per node, this srun step for 1: the step's count is the one that matters.
    narrowed = {**SLURM_STEP, "SLURM_NTASKS_PER_NODE": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}
    assert slurm_overrides(node, read_launch_env(narrowed, argv=[]))[0]["machine_rank"] == 1
    # accelerate gets SLURM's topology on its command line, not the profile file's
    plan = plan_launch(dataclasses.replace(node, **overrides), "accelerate", ["t.py"], gpus=2)
    flags = dict(zip(plan.command[3:-1:2], plan.command[4:-1:2]))
    assert (flags["--num_machines"], flags["--machine_rank"], flags["--main_process_ip"],
            flags["--main_process_port"]) == ("2", "1", "gpu07", "29500")
    outside = {k: v for k, v in SLURM_STEP.items() if k not in ("SLURM_STEP_ID", "SLURM_PROCID")}
    with pytest.raises(UserError, match="only this node would train"):
        slurm_overrides(node, read_launch_env(outside, argv=[]))
    assert slurm_overrides(node, read_launch_env({}, argv=[])) == ({}, [])


def test_dry_run_prints_command_and_environment(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    proc = run(TOOLKIT + ["launch", "--config_file", CONFIGS / "multi_gpu.yaml", "--engine", "ddp", "--dry-run",
                          script, "--lr", "0.1"])
    assert "TOOLKIT_ENGINE=ddp" in proc.stdout and "torch.distributed.run" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"{script} --lr 0.1")


@pytest.mark.parametrize("args, sentence", [
    (["--config_file", "nope.yaml"], "no accelerate profile at nope.yaml"),
    (["--config_file", "BAD", "--dry-run"], "is not valid YAML"),
    (["--config_file", "UNKNOWN"], "accelerate rejected"),
    (["--config_file", str(CONFIGS / "multi_gpu.yaml"), "--num_processes", "0"], "num_processes must be at least 1"),
    (["--config_file", str(CONFIGS / "multi_node.yaml"), "--machine_rank", "2"], "machine_rank 2 is outside 0..1"),
    (["--config_file", str(CONFIGS / "multi_gpu.yaml"), "--engine", "dp", "--num_processes", "2"], "dp engine"),
    (["--config_file", str(CONFIGS / "multi_node.yaml"), "--nnodes", "1:2", "--rdzv_keep_alive", "0"],
     "--rdzv_keep_alive must be a whole number of seconds, at least 1, not 0."),
])
def test_launch_errors_are_one_sentence_and_exit_2(tmp_path, args, sentence):
    (tmp_path / "BAD").write_text("distributed_type: [unclosed\n")
    (tmp_path / "UNKNOWN").write_text("distributed_type: 'NO'\nnum_processes: 1\nfancy_key: 1\n")
    script = tmp_path / "t.py"
    script.write_text("")
    args = [str(tmp_path / a) if a in ("BAD", "UNKNOWN") else a for a in args]
    proc = run(TOOLKIT + ["launch", *args, script], check=False, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and sentence in proc.stderr, proc.stderr
