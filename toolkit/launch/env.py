"""The one place that reads how this process was launched.

Every launcher leaves a different trail in the environment: torchrun and `accelerate launch` (which runs
torchrun inside) set RANK/WORLD_SIZE/LOCAL_RANK; the legacy `python -m torch.distributed.launch` also
passes `--local-rank=N` (or `--local_rank=N`) on the command line; `toolkit.spawn` sets torchrun's variables plus
TOOLKIT_LAUNCHER=spawn; `srun` sets SLURM_*; mpirun sets
OMPI_*/PMI_*; Azure ML and a Kubeflow PyTorchJob pod start plain processes with RANK/WORLD_SIZE of their own
(toolkit/launch/clusters.py reads those systems, Kubeflow Trainer's and SkyPilot's node variables too); plain
`python` sets nothing. `read_launch_env()` turns that into one frozen `LaunchEnv`,
which the rest of the toolkit reads and never mutates.

>>> env = read_launch_env(environ={}, argv=["train.py"])
>>> (env.launcher, env.rank, env.world_size)
('python', 0, 1)
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from toolkit.launch.clusters import Cluster, read_cluster
from toolkit.launch.engine_specs import LAUNCH_DEFAULT

# Variables `accelerate launch` sets for its children, whichever launcher it picks.
_ACCELERATE_MARKERS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")
_LEGACY_LOCAL_RANK = re.compile(r"^--local[-_]rank(?:=(\d+))?$")


@dataclass(frozen=True)
class LaunchEnv:
    """Who launched this process and where it sits in the world."""

    launcher: str  # "torchrun", "accelerate", "torch.distributed.launch", "spawn", "slurm", "mpi", "azureml",
    # "pytorchjob", "ray" or "python"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: str  # "cuda:<local_rank>" when CUDA is visible (cuda:0 when it is the only one), else "cpu"
    master_addr: str | None = None
    master_port: int | None = None
    # `accelerate launch` gave us MASTER_ADDR/PORT but no WORLD_SIZE: it was asked for several processes
    # and started only this one (a MULTI_CPU profile without mpirun does exactly that).
    accelerate_lost_processes: bool = False
    engine: str | None = None  # TOOLKIT_ENGINE, as `toolkit launch --engine` sets it
    mixed_precision: str | None = None  # ACCELERATE_MIXED_PRECISION, from the profile via either launcher
    restart_count: int = 0  # TORCHELASTIC_RESTART_COUNT: >0 when torchrun/toolkit launch restarted the job
    max_restarts: int = 0  # TORCHELASTIC_MAX_RESTARTS: the restarts torchrun allows in all
    agent_store: bool = False  # torchrun's agent hosts the rendezvous store: every rank connects as a client
    num_nodes: int = 1  # machines in the job: torchrun's GROUP_WORLD_SIZE, SLURM's node count
    job_id: str | None = None  # SLURM_JOB_ID: the same on every node of one allocation
    allocated_nodes: int = 1  # SLURM_JOB_NUM_NODES: nodes in the allocation, inside a step or not
    gloo_socket_ifname: str | None = None  # GLOO_SOCKET_IFNAME: the interface gloo binds to
    accelerate_fsdp: bool = False  # ACCELERATE_USE_FSDP: `accelerate launch` read a profile asking for FSDP
    accelerate_dynamo: bool = False  # ACCELERATE_DYNAMO_BACKEND (not NO): the profile's dynamo_config compiles
    # ACCELERATE_USE_PARALLELISM_CONFIG: the profile's parallelism_config, its PARALLELISM_CONFIG_*_SIZE values
    parallelism_sizes: dict | None = None
    use_cpu: bool = False  # ACCELERATE_USE_CPU: the profile asked for the CPU, GPUs or not
    parity_dir: str | None = None  # TOOLKIT_PARITY_DIR: `toolkit parity` started this run to record K steps
    debug_nan_step: int | None = None  # TOOLKIT_DEBUG_NAN_STEP: tests put a NaN in this step's loss on rank 0
    # TOOLKIT_DEBUG_STEP_MS: tests hold each optimizer step this long (no CPU, no change to the math), so that a
    # tiny run lasts longer than what they do to it meanwhile (a machine restarting and rejoining)
    debug_step_ms: int | None = None
    omp_num_threads: int | None = None  # OMP_NUM_THREADS when it is a thread count (torchrun sets 1 for workers)
    cpu_cores: int = 1  # the cores this process may run on: its CPU affinity (taskset, srun --cpu-bind, cpuset)
    cluster: Cluster | None = None  # Kubeflow, SkyPilot or Azure ML's job around this node (toolkit/launch/clusters.py)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Threads:
    """torch's intra-op threads in each process, and where the number comes from."""

    count: int
    reason: str  # "OMP_NUM_THREADS", "set by toolkit.spawn", or the rule's "8 cores / 2 processes"

    def __str__(self) -> str:
        return f"{self.count} thread{'s' if self.count != 1 else ''} per process ({self.reason})"


def threads_per_process(env: LaunchEnv, current: int) -> Threads:
    """How many intra-op threads a process should run: OMP_NUM_THREADS when it is set; else the cores this
    process may run on shared by the processes of its machine, at least 1 (torch's own default gives every
    process a thread per core it sees: N processes on C cores run N x C threads). A toolkit.spawn
    worker keeps the `current` count spawn gave it (one thread for several workers, and for a forked one, whose
    first parallel op could otherwise hang).

    >>> from dataclasses import replace
    >>> env = read_launch_env(environ={}, argv=["train.py"])
    >>> str(threads_per_process(replace(env, cpu_cores=16, local_world_size=3), current=16))
    '5 threads per process (16 cores / 3 processes)'
    >>> str(threads_per_process(replace(env, omp_num_threads=1, cpu_cores=16), current=1))
    '1 thread per process (OMP_NUM_THREADS)'
    """
    if env.launcher == "spawn":
        return Threads(current, "set by toolkit.spawn")
    if env.omp_num_threads is not None:
        return Threads(env.omp_num_threads, "OMP_NUM_THREADS")
    cores, processes = env.cpu_cores, env.local_world_size
    return Threads(max(1, cores // processes),
                   f"{cores} core{'s' if cores != 1 else ''} / {processes} process{'es' if processes != 1 else ''}")


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                # SLURM writes per-node counts as "2(x3)": the leading number is the count.
                return int(re.match(r"\d+", value).group(0)) if name.startswith("SLURM_") else int(value)
            except (ValueError, AttributeError):
                raise ValueError(f"environment variable {name}={value!r} is not an integer") from None
    return default


def _legacy_local_rank(argv: Sequence[str]) -> int | None:
    for i, arg in enumerate(argv):
        match = _LEGACY_LOCAL_RANK.match(arg)
        if match:
            value = match.group(1) if match.group(1) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            return int(value)
    return None


def _slurm_tasks_on_node(tasks_per_node: str, node: int) -> int:
    """Node `node`'s entry of a SLURM per-node count list: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"environment variable SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is not a task count list")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[min(node, len(counts) - 1)]


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return nodelist
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _device(local_rank: int, use_cpu: bool) -> str:
    import torch

    if use_cpu or not torch.cuda.is_available():
        return "cpu"
    # One visible GPU per rank (srun --gpus-per-task=1, --gpu-bind, MPI wrappers): that one is this rank's.
    return f"cuda:{local_rank if torch.cuda.device_count() > 1 else 0}"


def _slurm_step(environ: Mapping[str, str]) -> tuple:
    """(rank, world size, local rank, local world size, node rank, nodes, first host) of an srun task."""
    world_size = _int(environ, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", default=1)
    node_rank = _int(environ, "SLURM_NODEID", default=0)
    # The step's tasks on this node; SLURM_NTASKS_PER_NODE is the job's, which srun may have narrowed.
    local_world = (_slurm_tasks_on_node(environ["SLURM_STEP_TASKS_PER_NODE"], node_rank)
                   if environ.get("SLURM_STEP_TASKS_PER_NODE")
                   else _int(environ, "SLURM_NTASKS_PER_NODE", default=world_size))
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_NODELIST")
    return (_int(environ, "SLURM_PROCID"), world_size, _int(environ, "SLURM_LOCALID", default=0), local_world,
            node_rank, _int(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", default=1),
            first_slurm_host(nodelist) if nodelist else None)


def _torchrun_group(environ: Mapping[str, str], by_accelerate: bool, legacy_local_rank: int | None) -> tuple:
    """(launcher, rank, world size, local rank, local world size, node rank, nodes) under torchrun's variables."""
    if by_accelerate:
        launcher = "accelerate"
    elif environ.get("TOOLKIT_LAUNCHER") == "spawn":  # toolkit.spawn's workers (torch.multiprocessing)
        launcher = "spawn"
    elif legacy_local_rank is not None:
        launcher = "torch.distributed.launch"
    elif _ray_worker(environ):  # Ray Train's worker: Ray formed the process group before the training function
        launcher = "ray"
    else:
        launcher = "torchrun"
    world_size = _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK", default=legacy_local_rank if legacy_local_rank is not None else 0)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", default=world_size)
    nodes = max(1, world_size // max(1, local_world)) if launcher == "ray" else _int(environ, "GROUP_WORLD_SIZE", default=1)
    return (launcher, _int(environ, "RANK"), world_size, local_rank, local_world,
            _int(environ, "GROUP_RANK", "NODE_RANK", default=0), nodes)


def _started_by(cluster: Cluster | None, environ: Mapping[str, str], by_accelerate: bool) -> bool:
    """Whether the cluster system started this process itself, no launcher between: Azure ML one per GPU (RANK,
    LOCAL_RANK), a PyTorchJob pod's command one per pod (RANK, no LOCAL_RANK)."""
    launched = "TORCHELASTIC_RUN_ID" in environ or by_accelerate or environ.get("TOOLKIT_LAUNCHER") == "spawn"
    return bool(cluster) and "RANK" in environ and not launched and (
        cluster.name == "Azure ML" or cluster.name == "Kubeflow PyTorchJob" and "LOCAL_RANK" not in environ)


def _system_world(environ: Mapping[str, str], cluster: Cluster) -> tuple:
    """(launcher, rank, world size, local rank, local world size, node rank, nodes) of a process Azure ML or a
    PyTorchJob started (RANK of a PyTorchJob is the pod's index: one process per pod)."""
    launcher = "azureml" if cluster.name == "Azure ML" else "pytorchjob"
    local_world = cluster.processes_per_node if launcher == "azureml" else 1
    return (launcher, _int(environ, "RANK"), _int(environ, "WORLD_SIZE", default=cluster.nodes),
            _int(environ, "LOCAL_RANK", default=0), local_world, cluster.node_rank, cluster.nodes)


def _ray_worker(environ: Mapping[str, str]) -> bool:
    """A Ray Train worker (ray.train.torch sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_*;
    every Ray worker process has RAY_RAYLET_PID), not a torchrun started inside one (TORCHELASTIC_RUN_ID)."""
    return "RAY_RAYLET_PID" in environ and "TORCHELASTIC_RUN_ID" not in environ


def _mpi_world(environ: Mapping[str, str]) -> tuple:
    """(rank, world size, local rank, local world size, node rank, nodes) under mpirun (Open MPI or MPICH)."""
    world_size = _int(environ, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", default=world_size)
    return (_int(environ, "OMPI_COMM_WORLD_RANK", "PMI_RANK"), world_size,
            _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", default=0), local_world,
            _int(environ, "OMPI_COMM_WORLD_NODE_RANK", default=0), max(1, world_size // max(1, local_world)))


def launch_engine(asked: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """The engine `toolkit launch` starts and why: `asked` (--engine), else TOOLKIT_ENGINE, else the default.
    `toolkit launch` and `toolkit env` both ask here.

    >>> launch_engine("ddp", {}), launch_engine(None, {"TOOLKIT_ENGINE": "fsdp"}), launch_engine(None, {})
    (('ddp', '--engine'), ('fsdp', 'TOOLKIT_ENGINE'), ('accelerate', 'default'))
    """
    environ = os.environ if environ is None else environ
    if asked:
        return asked, "--engine"
    if environ.get("TOOLKIT_ENGINE"):
        return environ["TOOLKIT_ENGINE"], "TOOLKIT_ENGINE"
    return LAUNCH_DEFAULT, "default"


def cpu_profile(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the profile asked for the CPU (`use_cpu`, MULTI_CPU): the launchers then set ACCELERATE_USE_CPU, and
    it wins over any GPU on the host. read_launch_env (`LaunchEnv.use_cpu`) and spawn's device line ask here.

    >>> cpu_profile({"ACCELERATE_USE_CPU": "True"}), cpu_profile({"ACCELERATE_USE_CPU": "0"}), cpu_profile({})
    (True, False, False)
    """
    environ = os.environ if environ is None else environ
    return environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes", "y", "on")


def read_launch_env(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> LaunchEnv:
    """Read the launch environment once; see the module docstring for what each launcher sets."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    by_accelerate = any(name in environ for name in _ACCELERATE_MARKERS)
    legacy_local_rank = _legacy_local_rank(argv)
    master_addr = environ.get("MASTER_ADDR") or None
    master_port = _int(environ, "MASTER_PORT")
    use_cpu = cpu_profile(environ)
    slurm_step = "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ
    # Under Ray Train, Ray's group is the job (a Ray cluster inside SLURM or Kubernetes: those describe Ray's nodes).
    cluster = None if "RANK" in environ and _ray_worker(environ) else read_cluster(environ, slurm_step)
    if _started_by(cluster, environ, by_accelerate):
        launcher, rank, world_size, local_rank, local_world, node_rank, num_nodes = _system_world(environ, cluster)
    elif "RANK" in environ and "WORLD_SIZE" in environ:  # torchrun, accelerate launch, legacy launch, spawn
        launcher, rank, world_size, local_rank, local_world, node_rank, num_nodes = _torchrun_group(
            environ, by_accelerate, legacy_local_rank)
    elif "OMPI_COMM_WORLD_SIZE" in environ or "PMI_SIZE" in environ:
        launcher = "mpi"
        rank, world_size, local_rank, local_world, node_rank, num_nodes = _mpi_world(environ)
    elif slurm_step:  # inside `srun`, one task per rank
        launcher = "slurm"
        rank, world_size, local_rank, local_world, node_rank, num_nodes, first_host = _slurm_step(environ)
        master_addr = master_addr or first_host
    else:
        launcher = "accelerate" if by_accelerate else "python"
        rank, world_size, local_world, node_rank, num_nodes = 0, 1, 1, 0, 1
        local_rank = legacy_local_rank or 0

    return LaunchEnv(
        launcher=launcher, rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world,
        node_rank=node_rank,
        device=_device(local_rank, use_cpu),
        master_addr=master_addr,
        master_port=master_port,
        # WORLD_SIZE absent: a torchrun-started world of 1 is a real (if small) group, not a lost one.
        accelerate_lost_processes=by_accelerate and "WORLD_SIZE" not in environ and master_port is not None,
        engine=environ.get("TOOLKIT_ENGINE") or None,
        mixed_precision=environ.get("ACCELERATE_MIXED_PRECISION") or None,
        restart_count=_int(environ, "TORCHELASTIC_RESTART_COUNT", default=0),
        max_restarts=_int(environ, "TORCHELASTIC_MAX_RESTARTS", default=0),
        agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        num_nodes=num_nodes,
        job_id=environ.get("SLURM_JOB_ID") or None,
        allocated_nodes=_int(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES", default=1),
        gloo_socket_ifname=environ.get("GLOO_SOCKET_IFNAME") or None,
        accelerate_fsdp=environ.get("ACCELERATE_USE_FSDP", "").lower() == "true",
        accelerate_dynamo=environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no",
        parallelism_sizes=_parallelism(environ),
        use_cpu=use_cpu,
        parity_dir=environ.get("TOOLKIT_PARITY_DIR") or None,
        debug_nan_step=_int(environ, "TOOLKIT_DEBUG_NAN_STEP"),
        debug_step_ms=_int(environ, "TOOLKIT_DEBUG_STEP_MS"),
        omp_num_threads=_thread_count(environ.get("OMP_NUM_THREADS")),
        cpu_cores=_cpu_cores(),
        cluster=cluster,
    )


def _thread_count(value: str | None) -> int | None:
    """OMP_NUM_THREADS's count ("4", or "4,2" for nested levels); None when unset or not a count (OpenMP
    itself then warns and ignores it)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:,.*)?", value or "")
    return int(match.group(1)) if match and int(match.group(1)) > 0 else None


def _cpu_cores() -> int:
    """The cores this process may run on (os.cpu_count() counts the machine's, whatever the affinity)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def _parallelism(environ) -> dict | None:
    """The mesh accelerate launch hands over (ACCELERATE_USE_PARALLELISM_CONFIG, PARALLELISM_CONFIG_*_SIZE), with the
    toolkit's pipeline fields (PARALLELISM_CONFIG_PP_SIZE, _PP_SCHEDULE, _PP_MICROBATCHES), which toolkit launch sets."""
    if environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() != "true":
        return None
    found = {f"{dim}_size": _int(environ, f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", default=1)
             for dim in ("dp_replicate", "dp_shard", "tp", "cp", "sp", "pp")}
    if environ.get("PARALLELISM_CONFIG_PP_SCHEDULE"):
        found["pp_schedule"] = environ["PARALLELISM_CONFIG_PP_SCHEDULE"]
    if environ.get("PARALLELISM_CONFIG_PP_MICROBATCHES"):
        found["pp_microbatches"] = _int(environ, "PARALLELISM_CONFIG_PP_MICROBATCHES")
    return found
