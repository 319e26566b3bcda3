"""Where a launch's topology comes from besides its profile: SLURM's allocation inside `srun`, a Kubeflow, SkyPilot
or Azure ML node's variables (toolkit/launch/clusters.py), the flags
(--num_processes, --machine_rank, --main_process_port) and an elastic --nnodes MIN:MAX.
"""

from __future__ import annotations

from toolkit.errors import UserError
from toolkit.launch.engine_specs import engine_spec, engines_where
from toolkit.launch.env import LaunchEnv
from toolkit.launch.profiles import Profile
from toolkit.launch.rendezvous import MULTI_NODE_PORT

ELASTIC_RESTARTS = 3  # an elastic launch's default --max_restarts: each lost machine costs one




def topology_overrides(args, profile: Profile, engine: str, env: LaunchEnv) -> tuple[dict, list[str], int | None, int]:
    """(the profile fields to override, the notes that say so, the elastic minimum of machines or None, the
    launcher's --max_restarts) for `toolkit launch`'s arguments."""
    overrides, notes = system_overrides(profile, env)
    for flag in ("num_processes", "machine_rank", "main_process_port"):
        if getattr(args, flag) is not None:
            overrides[flag] = getattr(args, flag)
    min_nodes, max_restarts = None, args.max_restarts or 0
    if args.nnodes is not None:
        min_nodes, most = parse_nnodes(args.nnodes, engine)
        per_machine = overrides.get("num_processes", profile.num_processes) // profile.num_machines
        overrides.update(num_machines=most, num_processes=per_machine * most, rdzv_backend="c10d")
        if args.max_restarts is None:
            max_restarts = ELASTIC_RESTARTS
        notes.append(f"elastic: {min_nodes} to {most} machines of {per_machine} process(es) over torchrun's c10d "
                     f"rendezvous; a lost machine ends the round and the rest resume from the latest checkpoint "
                     f"(up to {max_restarts} restarts); the launch handshake is left to that rendezvous.")
    return overrides, notes, min_nodes, max_restarts


def system_overrides(profile: Profile, env: LaunchEnv) -> tuple[dict, list[str]]:
    """What the system that started this node decides of the topology: a Kubeflow, SkyPilot or Azure ML job's
    variables, or SLURM's allocation."""
    return cluster_overrides(profile, env) if env.cluster else slurm_overrides(profile, env)


def cluster_overrides(profile: Profile, env: LaunchEnv) -> tuple[dict, list[str]]:
    """On a Kubeflow, SkyPilot or Azure ML node, the system decides the topology (toolkit/launch/clusters.py): its
    node count, this node's rank and the main node's address and port; its processes per node when it names a
    number (PET_NPROC_PER_NODE), else the profile's."""
    cluster = env.cluster
    if env.launcher == "azureml":
        raise UserError("Azure ML starts one process per GPU itself (RANK, LOCAL_RANK are set): run the script with "
                        "plain python in the job's command, not under toolkit launch.")
    if env.launcher not in ("python", "pytorchjob"):
        raise UserError(f"toolkit launch runs once per {cluster.name} node, but {env.launcher} started this "
                        "process; put `toolkit launch` itself in the job's command.")
    per_node = cluster.processes_per_node or profile.processes_per_machine
    overrides = {"num_machines": cluster.nodes, "machine_rank": cluster.node_rank, "num_processes": per_node * cluster.nodes}
    where = ""
    if cluster.nodes > 1:
        if not cluster.master_addr:
            raise UserError(f"{cluster.name} names no main node (SKYPILOT_NODE_IPS is empty); the nodes cannot meet.")
        port = cluster.master_port or profile.main_process_port or MULTI_NODE_PORT  # the profile's 0: a free port
        overrides.update(main_process_ip=cluster.master_addr, main_process_port=port)
        where = f", main node {cluster.master_addr}:{port}"
    return overrides, [f"{cluster.name}: node {cluster.node_rank} of {cluster.nodes}, {per_node} process(es) per "
                       f"node{where}."]


def slurm_overrides(profile: Profile, env: LaunchEnv) -> tuple[dict, list[str]]:
    """Inside `srun`, SLURM decides the topology: one launcher per node, the first node is the main one."""
    if env.launcher != "slurm":
        if env.job_id and env.allocated_nodes > 1:
            raise UserError(f"SLURM job {env.job_id} has {env.allocated_nodes} nodes but toolkit launch runs outside "
                            "srun, so only this node would train; run `srun --ntasks-per-node=1 toolkit launch ...`.")
        return {}, []
    if env.local_world_size > 1:
        raise UserError(f"srun started {env.local_world_size} tasks on this node; toolkit launch starts the processes "
                        "itself: use `srun --ntasks-per-node=1 toolkit launch ...`.")
    port = profile.main_process_port or 20000 + int(env.job_id or 0) % 20000  # the same on every node of a job
    overrides = {"num_machines": env.num_nodes, "machine_rank": env.node_rank, "main_process_port": port,
                 "num_processes": profile.processes_per_machine * env.num_nodes,
                 "main_process_ip": env.master_addr if env.num_nodes > 1 else profile.main_process_ip}
    note = (f"SLURM job {env.job_id}: node {env.node_rank} of {env.num_nodes}, "
            f"{profile.processes_per_machine} process(es) per node, main node {overrides['main_process_ip']}:{port}.")
    return overrides, [note]


def parse_nnodes(text: str, engine: str) -> tuple[int, int]:
    """--nnodes MIN:MAX (or N, for MIN = MAX = N: a fixed count over the elastic rendezvous).

    >>> parse_nnodes("1:2", "ddp")
    (1, 2)
    >>> parse_nnodes("2:1", "ddp")
    Traceback (most recent call last):
    toolkit.errors.UserError: --nnodes 2:1: give MIN:MAX machines with 1 <= MIN <= MAX, e.g. --nnodes 1:2.
    """
    low, _, high = text.partition(":")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high:
        raise UserError(f"--nnodes {text}: give MIN:MAX machines with 1 <= MIN <= MAX, e.g. --nnodes 1:2.")
    if not engine_spec(engine).process_group:
        grouped = engines_where(lambda spec: spec.process_group)
        raise UserError(f"--nnodes {text}: the {engine} engine runs in one process; use --engine {grouped}.")
    return low, high
