"""The systems that start training where users' clusters already run, read from the variables each one sets
(toolkit/launch/env.py asks here; `toolkit launch` turns a node-level one into torchrun's flags):

| system | sets, per node or pod | per process |
|---|---|---|
| Kubeflow Trainer (v2 TrainJob) | PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT | nothing: it runs `torchrun` |
| Kubeflow PyTorchJob (Training Operator v1) | MASTER_ADDR, MASTER_PORT, PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK; WORLD_SIZE (pods x processes per pod), RANK (the pod's index) | nothing |
| SkyPilot | SKYPILOT_NODE_IPS (one per line, the head first), SKYPILOT_NODE_RANK, SKYPILOT_NUM_NODES, SKYPILOT_NUM_GPUS_PER_NODE | nothing |
| Azure ML (PyTorch distribution) | MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK, AZUREML_NODE_COUNT, AZUREML_RUN_ID | RANK, LOCAL_RANK |

Sources: kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go, kubeflow/trainer's torch plugin, SkyPilot's
"Distributed multi-node jobs" docs, Azure ML's "Distributed training with PyTorch" docs. A node-level system's
values become `toolkit launch`'s node count, this node's rank and the main node's address and port.

>>> read_cluster({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-node-0-0.job",
...               "PET_MASTER_PORT": "29400", "PET_NPROC_PER_NODE": "auto"})
Cluster(name='Kubeflow Trainer', nodes=2, node_rank=1, master_addr='job-node-0-0.job', master_port=29400, processes_per_node=None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class Cluster:
    """The job a cluster system started this node into."""

    name: str  # "Kubeflow Trainer", "Kubeflow PyTorchJob", "SkyPilot" or "Azure ML"
    nodes: int
    node_rank: int
    master_addr: str | None = None
    master_port: int | None = None  # None: the system names no port (SkyPilot); the profile's or 29500
    processes_per_node: int | None = None  # what the system starts per node, when it says a number


def _whole(environ: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise UserError(f"environment variable {name}={value!r} is not a whole number.")
    return int(value)


def _kubeflow(environ: Mapping[str, str]) -> Cluster | None:
    """Kubeflow: Trainer v2 hands torchrun its flags as PET_* (PET_MASTER_ADDR among them); the v1 PyTorchJob
    sets PET_NNODES and PET_NODE_RANK beside MASTER_ADDR/MASTER_PORT and a pod-level RANK/WORLD_SIZE."""
    if "PET_NNODES" not in environ:
        return None
    trainer = "PET_MASTER_ADDR" in environ
    nodes = environ["PET_NNODES"].strip()
    if ":" in nodes:  # an elastic PyTorchJob (MIN:MAX): torchrun's c10d rendezvous numbers the nodes itself
        raise UserError(f"PET_NNODES={nodes} asks for an elastic Kubeflow job; run it with `torchrun` and the "
                        "job's rendezvous, or give the job a fixed number of nodes for `toolkit launch`.")
    per_node = environ.get("PET_NPROC_PER_NODE", "").strip()
    return Cluster("Kubeflow Trainer" if trainer else "Kubeflow PyTorchJob", _whole(environ, "PET_NNODES"),
                   _whole(environ, "PET_NODE_RANK", default=0),
                   environ.get("PET_MASTER_ADDR" if trainer else "MASTER_ADDR") or None,
                   _whole(environ, "PET_MASTER_PORT" if trainer else "MASTER_PORT"),
                   int(per_node) if per_node.isdigit() else None)  # "auto", "cpu", "gpu": the profile's count


def _skypilot(environ: Mapping[str, str]) -> Cluster | None:
    if "SKYPILOT_NODE_RANK" not in environ and "SKYPILOT_NUM_NODES" not in environ:
        return None
    ips = [line.strip() for line in environ.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
    nodes = _whole(environ, "SKYPILOT_NUM_NODES", default=len(ips) or 1)
    if ips and len(ips) != nodes:
        raise UserError(f"SKYPILOT_NODE_IPS lists {len(ips)} addresses but SKYPILOT_NUM_NODES={nodes}; "
                        "the two must describe the same nodes.")
    return Cluster("SkyPilot", nodes, _whole(environ, "SKYPILOT_NODE_RANK", default=0), ips[0] if ips else None)


def _azureml(environ: Mapping[str, str]) -> Cluster | None:
    if "AZUREML_RUN_ID" not in environ and "AZUREML_NODE_COUNT" not in environ:
        return None
    nodes = _whole(environ, "AZUREML_NODE_COUNT", default=1)
    world = _whole(environ, "WORLD_SIZE")
    if world is not None and world % nodes:
        raise UserError(f"WORLD_SIZE={world} processes do not spread evenly over AZUREML_NODE_COUNT={nodes} nodes.")
    return Cluster("Azure ML", nodes, _whole(environ, "NODE_RANK", default=0), environ.get("MASTER_ADDR") or None,
                   _whole(environ, "MASTER_PORT"), world // nodes if world is not None else None)


_READERS = (_kubeflow, _skypilot, _azureml)
# The variable of each system that says which node this is, for the sentence that refuses a contradiction.
_NODE_RANK = {"Kubeflow Trainer": ("PET_NODE_RANK", "PET_NNODES"), "Kubeflow PyTorchJob": ("PET_NODE_RANK", "PET_NNODES"),
              "SkyPilot": ("SKYPILOT_NODE_RANK", "SKYPILOT_NUM_NODES"), "Azure ML": ("NODE_RANK", "AZUREML_NODE_COUNT")}


def read_cluster(environ: Mapping[str, str], slurm_step: bool = False) -> Cluster | None:
    """The cluster system that started this node, or None; one sentence (UserError) when the variables contradict
    each other: a node rank not below the node count, or two systems' variables at once (`slurm_step`: inside
    srun, which is a third)."""
    found = [cluster for cluster in (reader(environ) for reader in _READERS) if cluster is not None]
    names = [cluster.name for cluster in found] + (["SLURM (srun)"] if slurm_step else [])
    if len(names) > 1:
        raise UserError(f"this process holds the variables of both {names[0]} and {names[1]}: it can follow only "
                        "one system's node count and rank; unset the other's.")
    if not found:
        return None
    cluster = found[0]
    rank_name, count_name = _NODE_RANK[cluster.name]
    if cluster.nodes < 1 or not 0 <= cluster.node_rank < cluster.nodes:
        raise UserError(f"{rank_name}={cluster.node_rank} is not below {count_name}={cluster.nodes}: {cluster.name}'s "
                        f"nodes are numbered 0 to {cluster.nodes - 1}.")
    return cluster


def alone_under(cluster: Cluster | None, launcher: str, world_size: int) -> str | None:
    """The sentence that refuses a process its cluster meant to be one of many, started alone: plain `python`
    where the system starts nodes of processes for a launcher to fill (Kubeflow Trainer, SkyPilot), or a
    PyTorchJob pod's plain python where the job counts several processes per pod. None when it is not."""
    if cluster is None:
        return None
    if launcher == "python" and (cluster.nodes > 1 or (cluster.processes_per_node or 1) > 1):
        return (f"{cluster.name} runs this job on {cluster.nodes} node(s), but plain python started this process "
                f"alone; start the script with `toolkit launch --config_file PROFILE script.py` (or torchrun), which "
                f"reads {cluster.name}'s variables.")
    if launcher == "pytorchjob" and world_size != cluster.nodes:
        return (f"Kubeflow's PyTorchJob counts WORLD_SIZE={world_size} processes over PET_NNODES={cluster.nodes} pods, "
                "but this pod runs its script in one plain python process; start it with `toolkit launch` or torchrun.")
    return None
