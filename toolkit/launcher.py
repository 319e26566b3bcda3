"""`toolkit launch`: read an accelerate profile, then start exactly what the chosen engine needs.

    accelerate -> `accelerate launch --config_file X ...` (forced through its torchrun path on a machine
                  without GPUs, where a MULTI_CPU profile would otherwise start a single process)
    ddp        -> `python -m torch.distributed.run` with the profile's topology
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

from toolkit.engines import ENGINES
from toolkit.errors import UserError
from toolkit.profiles import Profile, check_profile, load_profile


@dataclass(frozen=True)
class LaunchPlan:
    command: list[str]
    env: dict[str, str]  # only what the launch adds to the current environment
    notes: tuple[str, ...] = ()
    restarts: int = 0  # restarts the launcher itself performs (one-process engines; torchrun does its own)


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
    if profile.use_cpu or profile.distributed_type in ("NO", "MULTI_CPU") and gpus == 0:
        return []
    if gpus == 0:
        return [f"no GPU visible: the {profile.processes_per_machine} process(es) per machine run on CPU with gloo."]
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
            port = 29500
        else:
            port = free_port()
            notes.append(f"main_process_port not set: using free local port {port}.")
    elif profile.machine_rank == 0 and profile.num_machines == 1 and port_in_use(host, port):
        raise UserError(f"port {port} on {host} is already in use; set another main_process_port or 0 for a free one.")
    return host, port, notes


def plan_launch(profile: Profile, engine: str, script_and_args: list[str], gpus: int | None = None,
                max_restarts: int = 0) -> LaunchPlan:
    """The command and environment that start `script_and_args` under `engine` with `profile`."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}.")
    gpus = visible_gpus() if gpus is None else gpus
    notes = check_devices(profile, gpus) if engine in ("accelerate", "ddp") else []
    env = {"TOOLKIT_ENGINE": engine, "ACCELERATE_MIXED_PRECISION": profile.mixed_precision}
    if profile.gpu_ids not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = profile.gpu_ids
    python = sys.executable
    if engine == "accelerate":
        command = [python, "-m", "accelerate.commands.launch", "--config_file", profile.path,
                   "--num_processes", str(profile.num_processes), "--machine_rank", str(profile.machine_rank)]
        if profile.num_processes > 1 and profile.distributed_type in ("MULTI_CPU", "NO") and gpus == 0:
            command.append("--multi_gpu")  # accelerate's torchrun path; the engine makes it a gloo group
            notes.append("MULTI_CPU without mpirun starts one process in accelerate: routed through torchrun.")
        if profile.main_process_port is None and profile.num_machines == 1:
            command += ["--main_process_port", str(free_port())]
        multi = profile.num_processes > 1 or profile.num_machines > 1 or "--multi_gpu" in command
        if max_restarts and multi:
            command += ["--max_restarts", str(max_restarts)]  # accelerate hands it to torchrun
        return LaunchPlan(command + list(script_and_args), env, tuple(notes), 0 if multi else max_restarts)
    if engine == "ddp":
        host, port, rdzv_notes = _rendezvous(profile)
        command = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(profile.processes_per_machine),
                   "--nnodes", str(profile.num_machines), "--node_rank", str(profile.machine_rank)]
        if profile.rdzv_backend == "c10d":
            command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{port}", "--rdzv_id", "toolkit"]
        else:
            command += ["--master_addr", host, "--master_port", str(port)]
        if max_restarts:
            command += ["--max-restarts", str(max_restarts)]
        return LaunchPlan(command + list(script_and_args), env, tuple(notes + rdzv_notes))
    if profile.num_processes > 1:
        notes.append(f"the {engine} engine runs one process; the profile's num_processes is not used.")
    return LaunchPlan([python] + list(script_and_args), env, tuple(notes), max_restarts)


def format_plan(plan: LaunchPlan) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(plan.env.items()))
    return f"{env} {shlex.join(plan.command)}"


# Exit codes that a restart cannot fix: success, a user error (exit 2), Ctrl-C.
NOT_RESTARTED = (0, 2, 130)


def run_plan(plan: LaunchPlan) -> int:
    """Run the plan, restarting a failed one-process run `plan.restarts` times (the child sees
    TORCHELASTIC_RESTART_COUNT, as under torchrun, and resumes from its latest checkpoint)."""
    for attempt in range(plan.restarts + 1):
        code = _run_once(plan, {"TORCHELASTIC_RESTART_COUNT": str(attempt)} if plan.restarts else {})
        if code in NOT_RESTARTED or attempt == plan.restarts:
            return code
        print(f"[toolkit] the run failed with exit code {code}; restart {attempt + 1} of {plan.restarts}.",
              file=sys.stderr, flush=True)
    return code


def _run_once(plan: LaunchPlan, extra_env: dict) -> int:
    """Ctrl-C and SIGTERM go to the child; its exit code comes back."""
    child = subprocess.Popen(plan.command, env={**os.environ, **plan.env, **extra_env})

    def forward(signum, _frame):
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = child.wait()
        return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(args) -> int:
    """Entry point of `toolkit launch` (args from `toolkit.cli`)."""
    profile = load_profile(args.config_file)
    overrides = {}
    if args.num_processes is not None:
        overrides["num_processes"] = args.num_processes
    if args.machine_rank is not None:
        overrides["machine_rank"] = args.machine_rank
    if args.main_process_port is not None:
        overrides["main_process_port"] = args.main_process_port
    if overrides:
        profile = dataclasses.replace(profile, **overrides)
        check_profile(profile)
    engine = args.engine or os.environ.get("TOOLKIT_ENGINE") or "accelerate"
    if engine == "dp" and args.num_processes not in (None, 1):
        raise UserError("the dp engine drives every GPU from one process; drop --num_processes or use --engine ddp.")
    if not args.script:
        raise UserError("no script given: toolkit launch --config_file PROFILE [options] script.py [args ...].")
    if not os.path.isfile(args.script[0]):
        raise UserError(f"no script at {args.script[0]}.")
    if args.max_restarts < 0:
        raise UserError(f"--max_restarts must be at least 0, not {args.max_restarts}.")
    plan = plan_launch(profile, engine, args.script, max_restarts=args.max_restarts)
    for note in plan.notes:
        print(f"[toolkit] {note}", file=sys.stderr)
    if args.dry_run:
        print(format_plan(plan))
        return 0
    return run_plan(plan)
