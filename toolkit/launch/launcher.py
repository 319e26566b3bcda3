"""`toolkit launch`: read an accelerate profile, then start exactly what the chosen engine needs.

    accelerate -> `accelerate launch --config_file X ...` (forced through its torchrun path on a machine
                  without GPUs, where a MULTI_CPU profile would otherwise start a single process)
    ddp, fsdp  -> `python -m torch.distributed.run` with the profile's topology
    dp, single -> one `python` process

Every child gets TOOLKIT_ENGINE, so `build_accelerator()` inside the script picks the same engine.

>>> plan = plan_launch(load_profile("accelerate_configs/multi_gpu.yaml"), "ddp", ["train.py"])
>>> plan.command[1:3]
['-m', 'torch.distributed.run']
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import NoReturn

from toolkit.errors import UserError
from toolkit.launch import rendezvous
from toolkit.launch.engine_specs import engine_spec, engines_where
from toolkit.launch.env import launch_engine, read_launch_env
from toolkit.launch.parallelism import ParallelismConfig, mesh_shape
from toolkit.launch.profiles import Profile, accelerate_environment, check_profile, load_profile
from toolkit.launch.rendezvous import MULTI_NODE_PORT
from toolkit.launch.topology import topology_overrides


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]  # only what the launch adds to the current environment
    notes: tuple[str, ...] = ()
    restarts: int = 0  # restarts the launcher itself performs (one-process engines; torchrun does its own)
    # torchrun's agent runs in the launcher's own process (one machine; on several, the launcher's handshake
    # store and the agent's would share a port in one process)
    agent_here: bool = False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(profile: Profile, gpus: int) -> list[str]:
    """Refuse a profile asking for more GPUs than this node has; on a machine without GPUs, say that the
    processes run on CPU instead."""
    if profile.use_cpu or profile.distributed_type == "MULTI_CPU":
        return []
    if gpus == 0:  # a GPU profile (single_gpu.yaml's NO included): say that it trains on the CPU
        return [f"no GPU visible: the {profile.processes_per_machine} process(es) per machine run on CPU"
                + (" with gloo." if profile.processes_per_machine > 1 or profile.num_machines > 1 else ".")]
    ids = [] if profile.gpu_ids in (None, "all") else [i.strip() for i in profile.gpu_ids.split(",") if i.strip()]
    for gpu in ids:
        if not gpu.isdigit() or int(gpu) >= gpus:
            raise UserError(f"{profile.path} names GPU {gpu} but this node has GPUs 0..{gpus - 1}.")
    available = len(ids) or gpus
    if profile.processes_per_machine > available:
        raise UserError(
            f"{profile.path} asks for {profile.processes_per_machine} processes per machine but only {available} "
            "GPU(s) are available to it; lower num_processes or add gpu_ids."
        )
    return []


def _rendezvous(profile: Profile) -> tuple[str, int, list[str]]:
    host = profile.main_process_ip or "127.0.0.1"  # single-node runs stay on loopback
    notes = []
    port = profile.main_process_port
    if port in (None, 0):
        if profile.num_machines > 1:
            port = MULTI_NODE_PORT
        else:
            port = free_port()
            if profile.main_process_port is None:  # 0 asks for exactly this: nothing to say
                notes.append(f"main_process_port not set: using free local port {port}.")
    elif profile.machine_rank == 0 and profile.num_machines == 1 and port_in_use(host, port):
        raise UserError(f"port {port} on {host} is already in use; set another main_process_port or 0 for a free one.")
    return host, port, notes


def _multi_node(profile: Profile, engine: str, environ, torchrun: bool) -> tuple[dict, list[str], list[str]]:
    """Environment, extra launcher arguments and notes for one machine of a multi-node job (`torchrun`: the
    launch runs torchrun itself, not accelerate launch)."""
    if not engine_spec(engine).process_group:
        grouped = engines_where(lambda spec: spec.process_group)
        raise UserError(f"the {engine} engine runs on one machine; use --engine {grouped} for "
                        f"num_machines {profile.num_machines}.")
    env, args, notes = {}, [], []
    try:
        local_ip, name = rendezvous.route_to(rendezvous.resolve_host(profile.main_process_ip))
    except UserError:  # a --dry-run elsewhere; a real launch stops at the handshake with this error
        local_ip = name = None
    if name and not environ.get("GLOO_SOCKET_IFNAME"):
        env["GLOO_SOCKET_IFNAME"] = name
        notes.append(f"gloo uses interface {name}, the route to {profile.main_process_ip} "
                     "(set GLOO_SOCKET_IFNAME to override).")
    if profile.rdzv_backend == "c10d":
        # torchrun guesses from this host's name whether it hosts the rendezvous store and what address the
        # other nodes reach it at; a name that resolves to 127.0.0.1 breaks both, so say it outright.
        args = ["--rdzv_conf", f"is_host={int(profile.machine_rank == 0)}"]
        if torchrun and local_ip:  # else the workers' MASTER_ADDR is this host's name
            args += ["--local_addr", local_ip]
    return env, args, notes


def _visible_devices(gpu_ids: str, environ) -> str:
    """CUDA_VISIBLE_DEVICES for a profile's gpu_ids: under an inherited CUDA_VISIBLE_DEVICES (a scheduler's
    allocation) they are positions in that list, not physical ids."""
    inherited = environ.get("CUDA_VISIBLE_DEVICES")
    if not inherited:
        return gpu_ids
    visible = [d.strip() for d in inherited.split(",") if d.strip()]
    ids = [int(i) for i in gpu_ids.split(",") if i.strip().isdigit()]
    return ",".join(visible[i] for i in ids if i < len(visible))


def _accelerate_command(profile: Profile, gpus: int, max_restarts: int, notes: list) -> tuple[list, bool]:
    """`accelerate launch` with every topology value on its command line (the profile's file may hold others:
    SLURM's node count and main node, --machine_rank) and whether it starts a torchrun group."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", profile.path,
               "--num_processes", str(profile.num_processes), "--num_machines", str(profile.num_machines),
               "--machine_rank", str(profile.machine_rank)]
    if profile.num_machines > 1:
        command += ["--main_process_ip", profile.main_process_ip,
                    "--main_process_port", str(profile.main_process_port or MULTI_NODE_PORT)]
    if profile.num_processes > 1 and (profile.distributed_type in ("MULTI_CPU", "NO") and gpus == 0
                                      or profile.distributed_type == "MULTI_CPU"):
        command.append("--multi_gpu")  # accelerate's torchrun path; the engine makes it a gloo group
        notes.append("MULTI_CPU without mpirun starts one process in accelerate: routed through torchrun.")
    if profile.main_process_port is None and profile.num_machines == 1:
        command += ["--main_process_port", str(free_port())]
    multi = profile.num_processes > 1 or profile.num_machines > 1 or "--multi_gpu" in command
    if max_restarts and multi:
        command += ["--max_restarts", str(max_restarts)]  # accelerate hands it to torchrun
    return command, multi


def _torchrun_command(profile: Profile, max_restarts: int, notes: list, min_nodes: int | None = None) -> list:
    host, port, rdzv_notes = _rendezvous(profile)
    notes += rdzv_notes
    nnodes = f"{min_nodes}:{profile.num_machines}" if min_nodes else str(profile.num_machines)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(profile.processes_per_machine),
               "--nnodes", nnodes]
    if profile.rdzv_backend == "c10d":  # c10d numbers the nodes itself
        command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{port}", "--rdzv_id", "toolkit"]
    else:
        command += ["--node_rank", str(profile.machine_rank), "--master_addr", host, "--master_port", str(port)]
    return command + (["--max-restarts", str(max_restarts)] if max_restarts else [])


def plan_launch(profile: Profile, engine: str, script_and_args: list[str], gpus: int | None = None,
                max_restarts: int = 0, environ=None, min_nodes: int | None = None,
                last_call_s: float | None = None, join_timeout_s: float | None = None,
                keep_alive_s: int | None = None) -> LaunchPlan:
    """The command and environment that start `script_and_args` under `engine` with `profile`; elastic between
    `min_nodes` and the profile's num_machines when `min_nodes` is given (torchrun's c10d rendezvous, for the
    accelerate engine too: accelerate launch takes one node count)."""
    spec = engine_spec(engine)
    environ = os.environ if environ is None else environ
    gpus = visible_gpus() if gpus is None else gpus
    notes = check_devices(profile, gpus) if spec.process_group else []
    env = {"TOOLKIT_ENGINE": engine, "ACCELERATE_MIXED_PRECISION": profile.mixed_precision}
    cpu_profile = profile.use_cpu or profile.distributed_type == "MULTI_CPU"
    if cpu_profile:
        env["ACCELERATE_USE_CPU"] = "true"  # every engine (and accelerate itself) trains on CPU, GPUs or not
    elif profile.gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = _visible_devices(profile.gpu_ids, environ)
    node_args = []
    if profile.num_machines > 1:
        node_env, node_args, node_notes = _multi_node(profile, engine, environ,
                                                      torchrun=bool(min_nodes) or spec.launcher == "torchrun")
        env.update(node_env)
        notes += node_notes
        if min_nodes and node_args:  # is_host=R is there: one --rdzv_conf for all
            node_args[1] += "".join(f",{key}={value:g}" for key, value in
                                    (("join_timeout", join_timeout_s), ("last_call_timeout", last_call_s),
                                     ("keep_alive_interval", keep_alive_s)) if value)
            # A lost machine's peers and the rendezvous store print C++ warnings with stack frames by the dozen
            # while the round ends; the workers' own line says what happened.
            if "TORCH_CPP_LOG_LEVEL" not in environ:
                env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
        if max_restarts:
            # torchrun keeps one store for every rendezvous round, and a node that only re-joins (its workers
            # did not fail) keeps its restart count: the old round's keys and mismatched per-attempt prefixes
            # would meet in it. A fresh store per round, hosted by the new rank 0, leaves nothing stale.
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if min_nodes or spec.launcher != "accelerate":  # accelerate launch hands them over itself
        # The profile's dynamo_config, and an FSDP profile's fsdp_config for the engines that shard by it.
        env.update(accelerate_environment(profile, fsdp=spec.shards or spec.accelerator))
    if min_nodes:
        command = _torchrun_command(profile, max_restarts, notes, min_nodes)
        return LaunchPlan(command + node_args + list(script_and_args), env, tuple(notes))
    if spec.launcher == "accelerate":
        command, multi = _accelerate_command(profile, gpus, max_restarts, notes)
        return LaunchPlan(command + node_args + list(script_and_args), env, tuple(notes), 0 if multi else max_restarts,
                          agent_here=multi and profile.num_machines == 1)
    if spec.launcher == "torchrun":
        command = _torchrun_command(profile, max_restarts, notes)
        return LaunchPlan(command + node_args + list(script_and_args), env, tuple(notes),
                          agent_here=profile.num_machines == 1)
    if profile.num_processes > 1:
        notes.append(f"the {engine} engine runs one process; the profile's num_processes is not used.")
    return LaunchPlan([sys.executable] + list(script_and_args), env, tuple(notes), max_restarts)


MESH_FLAGS = ("dp_replicate", "dp_shard", "tp", "cp", "pp")  # pp: the toolkit's own (Accelerate has none)


def with_mesh(plan: LaunchPlan, args, engine: str, processes: int) -> LaunchPlan:
    """accelerate launch's --parallelism_config_*_size flags over the profile's parallelism_config, handed to the
    processes as accelerate launch hands them; the mesh checked against the world before any process starts,
    for the engine that builds one."""
    given = {f"{dim}_SIZE": getattr(args, f"parallelism_config_{dim}_size", None) for dim in MESH_FLAGS}
    given.update(PP_SCHEDULE=getattr(args, "parallelism_config_pp_schedule", None),
                 PP_MICROBATCHES=getattr(args, "parallelism_config_pp_microbatches", None))
    env = dict(plan.env)
    if any(value is not None for value in given.values()):
        env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
        env.update({f"PARALLELISM_CONFIG_{key.upper()}": str(value) for key, value in given.items() if value is not None})
    sizes = mesh_sizes(env)
    if sizes is not None and engine_spec(engine).shards:
        mesh_shape(ParallelismConfig(**{f"{dim}_size": size for dim, size in sizes.items()},
                                     pp_schedule=env.get("PARALLELISM_CONFIG_PP_SCHEDULE", "1f1b")), processes, engine)
    return dataclasses.replace(plan, env=env)


def mesh_sizes(env: dict) -> dict | None:
    """The mesh a launch hands its processes (PARALLELISM_CONFIG_*_SIZE), or None."""
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") != "true":
        return None
    return {dim: int(env.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", 1)) for dim in MESH_FLAGS}


def format_plan(plan: LaunchPlan) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(plan.env.items()))
    return f"{env} {shlex.join(plan.command)}"


# Exit codes that a restart cannot fix: success, a user error (exit 2), Ctrl-C.
NOT_RESTARTED = (0, 2, 130)


def run_plan(plan: LaunchPlan) -> int:
    """Run the plan, restarting a failed one-process run `plan.restarts` times (the child sees
    TORCHELASTIC_RESTART_COUNT, as under torchrun, and resumes from its latest checkpoint)."""
    if plan.agent_here:
        _run_agent_here(plan)
    for attempt in range(plan.restarts + 1):
        code, stopped = _run_once(plan, {"TORCHELASTIC_RESTART_COUNT": str(attempt)} if plan.restarts else {})
        if stopped or code in NOT_RESTARTED or attempt == plan.restarts:
            return code
        print(f"[toolkit] the run failed with exit code {code}; restart {attempt + 1} of {plan.restarts}.",
              file=sys.stderr, flush=True)
    return code


QUIET_LAUNCHERS = ("torch.distributed.run", "accelerate.commands.launch")


def quiet_command(command: list[str]) -> list[str]:
    """The same launcher run through toolkit.launch.quiet: a worker's error is then its one sentence and
    exit code, without torchelastic's report and traceback around it."""
    if command[1:2] == ["-m"] and command[2] in QUIET_LAUNCHERS:
        return [command[0], "-m", "toolkit.launch.quiet", *command[2:]]
    return command


def _run_agent_here(plan: LaunchPlan) -> NoReturn:
    """torchrun's agent (accelerate's launcher runs it too) in this process, as toolkit.launch.quiet runs it:
    the workers are this process's children, and no second interpreter imports torch again (~2.5 s).
    Nothing is left to clean up once they are gone, so the process then ends without tearing down the
    interpreter (another ~0.7 s)."""
    from toolkit.launch import quiet

    os.environ.update(plan.env)
    quiet.exit_now(quiet.main(plan.command[2:]))


def _run_once(plan: LaunchPlan, extra_env: dict) -> tuple[int, bool]:
    """Run the plan's command once; (its exit code, whether Ctrl-C or SIGTERM stopped it). The child runs in a
    session of its own, as torchrun's workers do, so a terminal's Ctrl-C reaches it once: through here."""
    from toolkit.launch.quiet import catch_signals, stopped_line

    command = quiet_command(plan.command)
    agent = command != plan.command  # toolkit.launch.quiet stops its workers and says the line itself
    child, received = None, []

    def forward(signum, _frame):
        received.append(signum)
        if child is not None:
            # A script gets SIGTERM: while it still imports torch it then ends silently, where SIGINT would
            # print a KeyboardInterrupt traceback; its training loop (run_guard) takes both alike.
            child.send_signal(signum if agent else signal.SIGTERM)

    previous = catch_signals(forward)
    try:
        child = subprocess.Popen(command, env={**os.environ, **plan.env, **extra_env}, start_new_session=True)
        if received:  # arrived while it started
            forward(received.pop(), None)
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N
    if not received or agent or code in (0, 130):  # 130: run_guard stopped it and said at which step
        return code, bool(received)
    print(stopped_line(received[0]), file=sys.stderr, flush=True)
    return 128 + received[0], True


def launch(args) -> int:
    """Entry point of `toolkit launch` (args from `toolkit.cli`)."""
    try:
        return _launch(args)
    except KeyboardInterrupt:  # before the agent or the child took over Ctrl-C (importing torch takes seconds)
        from toolkit.launch.quiet import stopped_line

        print(stopped_line(signal.SIGINT), file=sys.stderr, flush=True)
        return 130


def _launch(args) -> int:
    profile = load_profile(args.config_file)
    engine, _ = launch_engine(args.engine)
    # A Kubeflow node's PET_* become torchrun's flags here; torchrun reads the same names as its flags' defaults.
    overrides, notes, min_nodes, max_restarts = topology_overrides(args, profile, engine, read_launch_env())
    if overrides:
        profile = dataclasses.replace(profile, **overrides)
        check_profile(profile)
    if engine_spec(engine).every_gpu and args.num_processes not in (None, 1):
        per_gpu = engines_where(lambda spec: spec.process_group)
        raise UserError(f"the {engine} engine drives every GPU from one process; drop --num_processes or use "
                        f"--engine {per_gpu} (one process per GPU).")
    if not args.script:
        raise UserError("no script given: toolkit launch --config_file PROFILE [options] script.py [args ...].")
    if not os.path.isfile(args.script[0]):
        raise UserError(f"no script at {args.script[0]}.")
    if max_restarts < 0:
        raise UserError(f"--max_restarts must be at least 0, not {max_restarts}.")
    if args.rdzv_timeout <= 0:
        raise UserError(f"--rdzv_timeout must be positive, not {args.rdzv_timeout:g}.")
    if args.rdzv_last_call < 0:
        raise UserError(f"--rdzv_last_call must be at least 0, not {args.rdzv_last_call:g}.")
    if args.rdzv_keep_alive < 1:
        raise UserError(f"--rdzv_keep_alive must be a whole number of seconds, at least 1, not {args.rdzv_keep_alive}.")
    plan = plan_launch(profile, engine, args.script, max_restarts=max_restarts, min_nodes=min_nodes,
                       last_call_s=args.rdzv_last_call, join_timeout_s=args.rdzv_timeout,
                       keep_alive_s=args.rdzv_keep_alive)
    plan = with_mesh(plan, args, engine, profile.num_processes)
    for note in notes + list(plan.notes):
        print(f"[toolkit] {note}", file=sys.stderr)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    if profile.num_machines > 1 and not min_nodes:  # an elastic machine may join a run long started
        rendezvous.meet_other_machines(profile, engine, args.script, args.rdzv_timeout)
    return run_plan(plan)
