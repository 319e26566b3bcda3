"""Where users' clusters already run: Kubeflow (Trainer v2's PET_* and the v1 PyTorchJob's variables), SkyPilot and
Azure ML, read from the variables each system sets (toolkit/launch/clusters.py), never translated by hand.

On the suite's two network hosts (tests/netns.py: 10.0.0.1 and 10.0.0.2, named node-T-0 and node-T-1 in each
other's /etc/hosts, as a cluster's DNS names pods), each system's variables, with the names and value shapes it
sets, start the same run as `toolkit launch --nnodes 2`:
- Kubeflow Trainer and SkyPilot: `toolkit launch` on each node starts torchrun from the variables alone;
- Azure ML (one process per GPU, started by Azure ML) and a PyTorchJob pod (one process per pod): plain `python`.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import CONFIGS, PY, ROOT, TOOLKIT, clean_env, kill_groups, run
from netns import hosts_or_skip
from toolkit.errors import UserError
from toolkit.launch.env import read_launch_env

CIFAR = ROOT / "recipes" / "cifar.py"
# 7 steps at global batch 64 (world 4: micro-batch 16; world 2: 32). --timeout 30: ranks that never meet (a rank
# read wrong) fail in 30 s, not the default 300.
FLAGS = ["--dataset", "synthetic", "--model", "tiny", "--max-steps", 7, "--global-batch-size", 64, "--lr", 0.05,
         "--seed", 1, "--mixed-precision", "no", "--timeout", 30]
STEPS = 7
# One process per node against two (world 2 against 4) changes only the rounding of the gradient's mean: the first
# 7 losses of 2 hosts x 2 and one process agree to 1e-5 (tests/test_multi_node.py measured it); a rank reading
# another's data or not averaging moves them by 1e-2 or more. Runs of the same world and placement are identical.
# Measured here, 2 pods x 1 against 2 x 2: 2.4e-7, on the AVX2 kernels and on ATEN_CPU_CAPABILITY=default with a
# busy loop beside the run alike.
WORLD_CHANGE_ATOL = 1e-5

hosts = pytest.fixture(scope="module", name="hosts")(hosts_or_skip)


def losses(out) -> list[float]:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["kind"] == "step"]


def profile(tmp_path, per_node: int) -> Path:
    """cpu.yaml for 2 machines of `per_node` processes, main node host 0 (what `--nnodes 2` reads)."""
    config = yaml.safe_load((CONFIGS / "cpu.yaml").read_text())
    config.update(num_processes=2 * per_node, num_machines=2, main_process_ip="10.0.0.1", main_process_port=29511)
    path = tmp_path / f"two-nodes-{per_node}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def on_hosts(hosts, tmp_path, starts, timeout=240):
    """starts: [(host, command, extra env)], all started at once; returns the logs, failing on any non-zero exit."""
    logs = [tmp_path / f"process{i}.log" for i in range(len(starts))]
    procs = [subprocess.Popen(hosts.prefix(host) + [str(c) for c in command], cwd=ROOT, env=clean_env(**env),
                              stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
             for (host, command, env), log in zip(starts, logs)]
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        kill_groups(procs)
    texts = [log.read_text() for log in logs]
    assert codes == [0] * len(procs), "\n\n".join(text[-2500:] for text in texts)
    return texts


@pytest.fixture(scope="module")
def reference(hosts, tmp_path_factory):
    """`toolkit launch --nnodes 2` of 2 processes per node on the two hosts."""
    tmp = tmp_path_factory.mktemp("nnodes")
    out = tmp / "run"
    on_hosts(hosts, tmp, [(host, TOOLKIT + ["launch", "--config_file", profile(tmp, 2), "--engine", "ddp",
                                            "--machine_rank", host, "--nnodes", 2, CIFAR, *FLAGS, "--output-dir", out],
                           {}) for host in (0, 1)])
    got = losses(out)
    assert len(got) == STEPS
    return got


def test_kubeflow_trainer_nodes_start_torchrun_from_pet_variables_alone(hosts, reference, tmp_path):
    # Trainer v2's torch plugin: PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR (node 0's DNS name),
    # PET_MASTER_PORT. cpu.yaml says one machine: every topology value comes from the variables.
    out = tmp_path / "run"
    texts = on_hosts(hosts, tmp_path, [(host, TOOLKIT + ["launch", "--config_file", CONFIGS / "cpu.yaml", "--engine",
                                                          "ddp", CIFAR, *FLAGS, "--output-dir", out],
                                        {"PET_NNODES": 2, "PET_NPROC_PER_NODE": 2, "PET_NODE_RANK": host,
                                         "PET_MASTER_ADDR": hosts.hostnames[0], "PET_MASTER_PORT": 29400})
                                       for host in (0, 1)])
    assert losses(out) == reference
    assert f"Kubeflow Trainer: node 1 of 2, 2 process(es) per node, main node {hosts.hostnames[0]}:29400." in texts[1]


def test_skypilot_nodes_start_torchrun_from_skypilot_variables_alone(hosts, reference, tmp_path):
    # SkyPilot: the nodes' addresses one per line (the head first), this node's rank, the count; it names no port.
    out = tmp_path / "run"
    texts = on_hosts(hosts, tmp_path, [(host, TOOLKIT + ["launch", "--config_file", CONFIGS / "cpu.yaml", "--engine",
                                                          "ddp", CIFAR, *FLAGS, "--output-dir", out],
                                        {"SKYPILOT_NODE_IPS": "10.0.0.1\n10.0.0.2", "SKYPILOT_NODE_RANK": host,
                                         "SKYPILOT_NUM_NODES": 2, "SKYPILOT_NUM_GPUS_PER_NODE": 0})
                                       for host in (0, 1)])
    assert losses(out) == reference
    assert "SkyPilot: node 0 of 2, 2 process(es) per node, main node 10.0.0.1:29500." in texts[0]


def test_azure_ml_processes_run_plain_python_as_their_ranks(hosts, reference, tmp_path):
    # Azure ML's PyTorch distribution starts each process itself: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK
    # per node, RANK and LOCAL_RANK per process, AZUREML_NODE_COUNT and AZUREML_RUN_ID; no torchrun.
    out = tmp_path / "run"
    job = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": 6105, "WORLD_SIZE": 4, "AZUREML_NODE_COUNT": 2,
           "AZUREML_RUN_ID": "toolkit_test_1733500000_5f2c0a1e"}
    on_hosts(hosts, tmp_path, [(node, [PY, CIFAR, *FLAGS, "--output-dir", out],
                                {**job, "NODE_RANK": node, "RANK": 2 * node + local, "LOCAL_RANK": local})
                               for node in (0, 1) for local in (0, 1)])
    assert losses(out) == reference
    assert json.loads((out / "summary.json").read_text())["world_size"] == 4


def test_pytorchjob_pods_run_plain_python_as_their_ranks(hosts, reference, tmp_path):
    # The v1 PyTorchJob: the master service's name and port, WORLD_SIZE = pods x processes per pod, RANK = the pod's
    # index (master 0, worker 0 is 1), PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE ("auto" by default).
    out = tmp_path / "run"
    on_hosts(hosts, tmp_path, [(pod, [PY, CIFAR, *FLAGS, "--output-dir", out],
                                {"MASTER_ADDR": hosts.hostnames[0], "MASTER_PORT": 23456, "WORLD_SIZE": 2,
                                 "RANK": pod, "PET_NNODES": 2, "PET_NODE_RANK": pod, "PET_NPROC_PER_NODE": "auto",
                                 "PYTHONUNBUFFERED": 0}) for pod in (0, 1)])
    got = losses(out)
    spread = max(abs(a - b) for a, b in zip(got, reference))
    print(f"PyTorchJob, 2 pods x 1 process against 2 x 2: the 7 losses within {spread:.1e}")
    assert len(got) == STEPS and spread <= WORLD_CHANGE_ATOL
    assert json.loads((out / "summary.json").read_text())["world_size"] == 2


# Reading the variables, in-process (no hosts): each system's shape, and what contradicts itself.
def test_each_system_is_read_as_the_right_rank_of_the_right_world():
    azure = read_launch_env({"AZUREML_RUN_ID": "r", "AZUREML_NODE_COUNT": "2", "NODE_RANK": "1", "RANK": "3",
                             "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "6105"})
    assert (azure.launcher, azure.rank, azure.world_size, azure.local_rank, azure.local_world_size, azure.node_rank,
            azure.num_nodes) == ("azureml", 3, 4, 1, 2, 1, 2)
    job = read_launch_env({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "auto", "RANK": "2",
                           "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (job.launcher, job.rank, job.world_size, job.local_world_size, job.num_nodes) == ("pytorchjob", 2, 3, 1, 3)
    # torchrun inside a Kubeflow Trainer pod: torchrun's own variables give the process's place, PET_* the node's.
    worker = read_launch_env({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2",
                              "PET_MASTER_ADDR": "n0", "PET_MASTER_PORT": "29400", "RANK": "3", "LOCAL_RANK": "1",
                              "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                              "TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"})
    assert (worker.launcher, worker.rank, worker.local_rank, worker.cluster.name) == ("torchrun", 3, 1,
                                                                                      "Kubeflow Trainer")
    sky = read_launch_env({"SKYPILOT_NODE_IPS": "10.1.0.7\n10.1.0.9", "SKYPILOT_NODE_RANK": "1",
                           "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "8"})
    assert (sky.launcher, sky.cluster.nodes, sky.cluster.node_rank, sky.cluster.master_addr) == ("python", 2, 1,
                                                                                               "10.1.0.7")


@pytest.mark.parametrize("variables, said", [
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "n0"}, "PET_NODE_RANK=2 is not below PET_NNODES=2"),
    ({"SKYPILOT_NODE_RANK": "3", "SKYPILOT_NUM_NODES": "2"}, "SKYPILOT_NODE_RANK=3 is not below SKYPILOT_NUM_NODES=2"),
    ({"AZUREML_NODE_COUNT": "2", "NODE_RANK": "2", "RANK": "0", "WORLD_SIZE": "4"}, "NODE_RANK=2 is not below "
     "AZUREML_NODE_COUNT=2"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "n0", "SKYPILOT_NUM_NODES": "2",
      "SKYPILOT_NODE_RANK": "0"}, "both Kubeflow Trainer and SkyPilot"),
    ({"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0", "SLURM_PROCID": "0", "SLURM_STEP_ID": "0"},
     "both SkyPilot and SLURM (srun)"),
    ({"SKYPILOT_NODE_IPS": "10.1.0.7", "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0"}, "lists 1 addresses"),
    ({"PET_NNODES": "two", "PET_MASTER_ADDR": "n0"}, "PET_NNODES='two' is not a whole number"),
])
def test_contradicting_variables_are_one_sentence(variables, said):
    with pytest.raises(UserError, match=re.escape(said)):
        read_launch_env(variables)


def test_contradictions_and_a_lone_process_are_refused_in_one_sentence_exit_2(tmp_path):
    cases = [
        # a plain python on a 2-node Kubeflow Trainer job would train alone: refused, with what to run instead
        ([PY, CIFAR], {"PET_NNODES": 2, "PET_NODE_RANK": 0, "PET_MASTER_ADDR": "n0", "PET_MASTER_PORT": 29400},
         "Kubeflow Trainer runs this job on 2 node(s), but plain python started this process alone"),
        # a PyTorchJob of 2 processes per pod whose pod runs plain python
        ([PY, CIFAR], {"PET_NNODES": 2, "PET_NODE_RANK": 0, "PET_NPROC_PER_NODE": 2, "RANK": 0, "WORLD_SIZE": 4,
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 23456}, "counts WORLD_SIZE=4 processes over "
                                                                          "PET_NNODES=2 pods"),
        (TOOLKIT + ["launch", "--config_file", CONFIGS / "cpu.yaml", CIFAR],
         {"SKYPILOT_NUM_NODES": 2, "SKYPILOT_NODE_RANK": 2}, "SKYPILOT_NODE_RANK=2 is not below SKYPILOT_NUM_NODES=2"),
        (TOOLKIT + ["launch", "--config_file", CONFIGS / "cpu.yaml", CIFAR],
         {"AZUREML_RUN_ID": "r", "AZUREML_NODE_COUNT": 1, "PET_NNODES": 1, "PET_MASTER_ADDR": "n0"},
         "both Kubeflow Trainer and Azure ML"),
    ]
    for command, variables, said in cases:
        proc = run([*command, "--dataset", "synthetic", "--output-dir", tmp_path / "out"], check=False, timeout=120,
                   **variables)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], (variables, proc.stderr)
        assert not (tmp_path / "out").exists()


def test_toolkit_env_names_the_system(tmp_path):
    proc = run(TOOLKIT + ["env", "--config_file", CONFIGS / "cpu.yaml", "--json"], PET_NNODES=2, PET_NODE_RANK=1,
               PET_NPROC_PER_NODE=1, PET_MASTER_ADDR="10.0.0.1", PET_MASTER_PORT=29400)
    report = json.loads(proc.stdout)
    assert report["launch_environment"]["cluster"] == {"name": "Kubeflow Trainer", "nodes": 2, "node_rank": 1}
    topology = report["profile"]
    assert (topology["num_machines"], topology["machine_rank"], topology["main_process_ip"]) == (2, 1, "10.0.0.1")
    text = run(TOOLKIT + ["env", "--config_file", CONFIGS / "cpu.yaml"], SKYPILOT_NUM_NODES=1,
               SKYPILOT_NODE_RANK=0).stdout
    assert "cluster      SkyPilot: node 0 of 1" in text
