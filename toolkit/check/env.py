"""`toolkit env`: what will run on this machine and why, and every mismatch visible before launching.

    toolkit env                                              # accelerate's default config, if there is one
    toolkit env --config_file accelerate_configs/cpu.yaml    # readable
    toolkit env --config_file accelerate_configs/cpu.yaml --json

It reads the profile with the launcher's own helpers (`load_profile`, `check_devices`, `plan_launch`), so
what it shows is what `toolkit launch` would do. Exit code: 0 when nothing found would stop or spoil a
launch, 1 when something would (an "error" finding), 2 for a bad profile.

>>> report = collect(None, environ={})
>>> sorted(report)
['accelerate_default_config', 'devices', 'findings', 'launch_environment', 'profile', 'toolkit_launch', 'versions']
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version

from toolkit.engines import FSDP_WITHOUT_CUDA, resolve_engine
from toolkit.errors import UserError
from toolkit.launch.engine_specs import engine_spec, engines_where
from toolkit.launch.env import launch_engine, read_launch_env
from toolkit.launch.launcher import (
    check_devices,
    format_plan,
    mesh_sizes,
    plan_launch,
    with_mesh,
    port_in_use,
    visible_gpus,
)
from toolkit.launch.parallelism import mesh_story
from toolkit.launch.profiles import Profile, accelerate_environment, check_profile, load_profile
from toolkit.launch.rendezvous import check_main_host, resolve_host
from toolkit.launch.topology import system_overrides

# What torchrun and `accelerate launch` leave in their children's environment: set in the shell that starts a
# new job, they make its processes think they belong to the old one. (SLURM's and MPI's own variables are the
# normal setting of `srun toolkit launch` and are read as such.)
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                    "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_CPU",
                    "TOOLKIT_PARITY_DIR")


@dataclass(frozen=True)
class Finding:
    severity: str  # "error": the launch would fail or train wrong; "warning": it runs, maybe not as meant
    code: str  # stable: port-in-use, fp16-on-cpu, too-few-gpus, ...
    message: str


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def versions() -> dict:
    import torch

    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError, TypeError):
        nccl = None  # a build without NCCL (CPU-only wheels, macOS)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": cudnn, "nccl": nccl, "accelerate": _package_version("accelerate"),
            "datasets": _package_version("datasets"), "toolkit": _package_version("toolkit")}


def devices(environ: Mapping[str, str]) -> dict:
    import torch

    gpus = []
    for index in range(visible_gpus()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "capability": f"{props.major}.{props.minor}"})
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpus": os.cpu_count(), "cpus_usable": usable, "gpus": gpus,
            "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES")}


def launch_environment(environ: Mapping[str, str]) -> tuple[dict, list[Finding]]:
    """Where a process started from this shell would sit, and the engine `auto` would pick for it."""
    try:
        env = read_launch_env(environ, argv=["toolkit"])
        auto = resolve_engine("auto", env)
    except (ValueError, UserError) as error:
        info = dict.fromkeys(("launcher", "rank", "world_size", "auto_engine", "auto_reason", "toolkit_engine",
                              "cluster"))
        return info, [Finding("error", "bad-launch-variable", f"{str(error).rstrip('.')}; fix or unset it.")]
    reason = f"TOOLKIT_ENGINE={env.engine}" if env.engine else f"launched by {env.launcher}"
    info = {"launcher": env.launcher, "rank": env.rank, "world_size": env.world_size,
            "auto_engine": auto, "auto_reason": reason, "toolkit_engine": env.engine,
            "cluster": None if env.cluster is None else {"name": env.cluster.name, "nodes": env.cluster.nodes,
                                                         "node_rank": env.cluster.node_rank}}
    # Under Azure ML and a PyTorchJob the system set them for this job; elsewhere a parent job left them.
    present = [] if env.launcher in ("azureml", "pytorchjob") else [name for name in LAUNCH_VARIABLES if name in environ]
    findings = []
    if present:
        shown = ", ".join(f"{name}={environ[name]}" for name in present)
        findings.append(Finding("warning", "launch-variables-set", (
            f"{shown} already set here (left by a parent job?): a plain `python` run would take them as its place in "
            "that job; unset them before launching a new one.")))
    return info, findings


def default_config_file() -> str:
    """Where plain `accelerate launch` (no --config_file) looks: $HF_HOME or $XDG_CACHE_HOME/huggingface, then
    accelerate/default_config.yaml, as accelerate itself computes it."""
    from accelerate.commands.config.config_args import default_config_file as path

    return path


def find_profile(config_file: str | None) -> tuple[Profile | None, str | None]:
    """The profile to describe and where it came from; a bad --config_file raises UserError (exit 2)."""
    if config_file:
        return load_profile(config_file), "--config_file"
    if os.path.isfile(default_config_file()):
        return load_profile(default_config_file()), "accelerate default config"
    return None, None


def runs_on(profile: Profile, gpus: int) -> str:
    return "cpu" if profile.use_cpu or profile.distributed_type == "MULTI_CPU" or gpus == 0 else "cuda"


def topology(profile: Profile, source: str, gpus: int) -> dict:
    device = runs_on(profile, gpus)
    return {"path": profile.path, "source": source, "distributed_type": profile.distributed_type,
            "num_machines": profile.num_machines, "processes_per_machine": profile.processes_per_machine,
            "world_size": profile.num_processes, "machine_rank": profile.machine_rank,
            "main_process_ip": profile.main_process_ip, "main_process_port": profile.main_process_port,
            "rdzv_backend": profile.rdzv_backend, "mixed_precision": profile.mixed_precision,
            "use_cpu": profile.use_cpu, "gpu_ids": profile.gpu_ids, "device": device,
            "backend": "gloo" if device == "cpu" else "nccl"}


def as_launched(profile: Profile | None, environ: Mapping[str, str]) -> tuple[Profile | None, list[str], list[Finding]]:
    """The profile as `toolkit launch` would use it here: inside `srun`, SLURM sets the topology; on a Kubeflow,
    SkyPilot or Azure ML node, that system's variables do."""
    try:
        launch_env = read_launch_env(environ, argv=["toolkit"])
    except (ValueError, UserError):
        return profile, [], []  # already reported as bad-launch-variable
    if profile is None:
        return profile, [], []
    try:
        overrides, notes = system_overrides(profile, launch_env)
        profile = dataclasses.replace(profile, **overrides)
        check_profile(profile)
    except UserError as error:
        return profile, [], [Finding("error", "slurm-mismatch" if launch_env.cluster is None else "cluster-mismatch",
                                     str(error))]
    return profile, notes, []


def toolkit_launch(profile: Profile | None, environ: Mapping[str, str], gpus: int) -> tuple[dict, list[Finding]]:
    """What `toolkit launch --config_file PROFILE script.py` would start (engine, command, launcher notes)."""
    engine, reason = launch_engine(None, environ)
    info = {"engine": engine, "engine_reason": reason,
            "command": None, "notes": [], "runs": engine, "mesh": None}
    if profile is None:
        return info, []
    try:
        plan = plan_launch(profile, engine, ["script.py"], gpus=gpus, environ=environ)
    except UserError as error:
        return info, [Finding("error", "launch-refused", str(error))]
    info.update(command=format_plan(plan), notes=list(plan.notes))
    findings = fsdp_findings(profile, engine, gpus, info)
    # The profile's parallelism_config (accelerate launch hands it over itself), checked as toolkit launch checks it.
    plan = dataclasses.replace(plan, env={**accelerate_environment(profile, fsdp=True), **plan.env})
    info["mesh"] = mesh_sizes(plan.env)
    try:
        with_mesh(plan, argparse.Namespace(), info["runs"], profile.num_processes)
    except UserError as error:
        findings.append(Finding("error", "mesh-refused", str(error)))
    return info, findings


def fsdp_findings(profile: Profile, engine: str, gpus: int, info: dict) -> list[Finding]:
    """An FSDP profile must shard: say which engine really runs it when that is not accelerate's FSDP."""
    if profile.distributed_type != "FSDP":
        return []
    spec = engine_spec(engine)
    if spec.fsdp_without_cuda and runs_on(profile, gpus) == "cpu":
        info["runs"] = spec.fsdp_without_cuda
        return [Finding("warning", "fsdp-without-cuda", FSDP_WITHOUT_CUDA)]
    if not spec.shards:
        sharding = engines_where(lambda s: s.shards and not s.fsdp_without_cuda)
        return [Finding("warning", "fsdp-profile-replicated", (
            f"{profile.path} asks for FSDP but the {engine} engine keeps a whole copy of the model in every process; "
            f"use --engine {sharding} (or {engines_where(lambda s: bool(s.fsdp_without_cuda))} on GPUs) to shard it."))]
    return []


def _local_address(host: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((host, 0))
        return True
    except OSError:
        return False


def rendezvous_findings(profile: Profile) -> list[Finding]:
    """When this machine hosts the rendezvous (machine_rank 0): the main address must be one of its own and a
    fixed port must be free. The sentences are the launcher's, so a refusal it repeats is said once."""
    host, port = profile.main_process_ip or "127.0.0.1", profile.main_process_port
    if profile.machine_rank != 0:
        return []  # this machine joins; the main one hosts the store
    if profile.num_machines > 1:
        try:
            host = resolve_host(host)
        except UserError as error:
            return [Finding("error", "main-address-unresolved", str(error))]
        try:
            check_main_host(profile.main_process_ip)
        except UserError as error:
            return [Finding("error", "main-address-not-here", str(error))]
    if port in (None, 0) or not _local_address(host):
        return []
    if port_in_use(host, port):
        return [Finding("error", "port-in-use",
                        f"port {port} on {host} is already in use; set another main_process_port or 0 for a free one.")]
    return []


def _bf16_gpu() -> bool:
    import torch

    return torch.cuda.is_bf16_supported(including_emulation=False)


def profile_findings(profile: Profile, gpus: int, cpus: int) -> list[Finding]:
    findings = []
    try:
        notes = check_devices(profile, gpus)
        findings += [Finding("warning", "no-gpu", note) for note in notes]
    except UserError as error:
        findings.append(Finding("error", "too-few-gpus", str(error)))
    device = runs_on(profile, gpus)
    if device == "cpu" and profile.processes_per_machine > cpus:
        findings.append(Finding("warning", "more-processes-than-cpus", (
            f"{profile.processes_per_machine} processes per machine share {cpus} usable CPU core(s); they will "
            "run, slowly.")))
    if profile.distributed_type == "MULTI_CPU" and profile.num_processes > 1:
        findings.append(Finding("warning", "multi-cpu-without-mpirun", (
            f"distributed_type MULTI_CPU: plain `accelerate launch` starts its {profile.num_processes} processes only "
            "through mpirun (mpirun_config in the profile) and otherwise starts ONE; `toolkit launch` routes it "
            "through torchrun, or use MULTI_GPU with use_cpu: true as accelerate_configs/cpu.yaml does.")))
    if profile.mixed_precision == "fp16" and device == "cpu":
        findings.append(Finding("error", "fp16-on-cpu",
                                "fp16 mixed precision needs a CUDA device; use bf16 (or no) on CPU."))
    if profile.mixed_precision == "bf16" and device == "cuda" and not _bf16_gpu():
        findings.append(Finding("warning", "bf16-emulated", (
            "this GPU has no native bf16 (it needs compute capability 8.0, Ampere, or newer): bf16 runs emulated and "
            "slow; use fp16 on it.")))
    return findings + rendezvous_findings(profile)


def shadow_findings(profile: Profile | None, source: str | None) -> tuple[dict, list[Finding]]:
    """accelerate's default config: what plain `accelerate launch` uses when it is not given --config_file."""
    path = default_config_file()
    info = {"path": path, "exists": os.path.isfile(path)}
    if not info["exists"] or source != "--config_file":
        return info, []
    try:
        default = load_profile(path)
    except UserError as error:
        return info, [Finding("warning", "default-config-invalid", (
            f"plain `accelerate launch` without --config_file would fail on accelerate's default config: {error}"))]
    if same_topology(default, profile):
        return info, []
    return info, [Finding("warning", "default-config-shadows", (
        f"plain `accelerate launch` without --config_file reads {path} ({default.distributed_type}, "
        f"{default.num_processes} process(es), mixed precision {default.mixed_precision}), not {profile.path}; "
        "always pass --config_file, or use toolkit launch."))]


def same_topology(a: Profile, b: Profile) -> bool:
    return {**asdict(a), "path": None} == {**asdict(b), "path": None}


def collect(config_file: str | None, environ: Mapping[str, str] | None = None) -> dict:
    """Everything `toolkit env` shows, as a JSON-ready dict with stable keys (see the module docstring)."""
    environ = os.environ if environ is None else environ
    profile, source = find_profile(config_file)
    hardware = devices(environ)
    gpus = len(hardware["gpus"])
    launch_info, findings = launch_environment(environ)
    profile, slurm_notes, slurm_findings = as_launched(profile, environ)
    findings += slurm_findings
    plan_info, plan_findings = toolkit_launch(profile, environ, gpus)
    plan_info["notes"] = slurm_notes + plan_info["notes"]
    default_info, shadow = shadow_findings(profile, source)
    if profile is not None:
        findings += profile_findings(profile, gpus, hardware["cpus_usable"])
    seen = {f.message for f in findings}  # the launcher's refusals and notes repeat some findings: say each once
    findings += [f for f in plan_findings if f.message not in seen] + shadow
    plan_info["notes"] = [note for note in plan_info["notes"] if note not in seen]
    return {
        "versions": versions(),
        "devices": hardware,
        "launch_environment": launch_info,
        "profile": None if profile is None else topology(profile, source, gpus),
        "toolkit_launch": plan_info,
        "accelerate_default_config": default_info,
        "findings": [asdict(f) for f in findings],
    }


def _versions_line(v: dict) -> str:
    native = ", ".join(f"{k} {v[k]}" for k in ("cuda", "cudnn", "nccl") if v[k])
    torch_part = f"torch {v['torch']}" + (f" ({native})" if native else "")
    rest = ", ".join(f"{k} {v[k] or 'not installed'}" for k in ("accelerate", "datasets", "toolkit"))
    return f"python {v['python']}, {torch_part}, {rest}"


def _devices_line(d: dict) -> str:
    gpus = "; ".join(f"GPU {g['index']} {g['name']} {g['memory_gib']} GiB (sm {g['capability']})" for g in d["gpus"])
    visible = f" (CUDA_VISIBLE_DEVICES={d['cuda_visible_devices']})" if d["cuda_visible_devices"] is not None else ""
    return f"{d['cpus']} CPU core(s), {d['cpus_usable']} usable; {gpus or 'no GPU visible'}{visible}"


def _profile_lines(p: dict | None) -> list[str]:
    if p is None:
        return [("profile      none: no --config_file and no accelerate default config (plain `accelerate launch` "
                 "runs one process; toolkit launch needs --config_file)")]
    port = p["main_process_port"] if p["main_process_port"] not in (None, 0) else "a free port picked at launch"
    kind = p["distributed_type"] + (", use_cpu" if p["use_cpu"] else "")
    topology = (f"{p['num_machines']} machine(s) x {p['processes_per_machine']} process(es) = world size "
                f"{p['world_size']} ({kind}); this is machine {p['machine_rank']}")
    rendezvous = "none (one process)"
    if p["world_size"] > 1:
        rendezvous = f"{p['rdzv_backend']} at {p['main_process_ip'] or '127.0.0.1'}:{port}"
    gpu_ids = f", gpu_ids {p['gpu_ids']}" if p["gpu_ids"] else ""
    return [f"profile      {p['path']} ({p['source']})", f"  topology   {topology}",
            f"  devices    {p['device']} with {p['backend']}{gpu_ids}", f"  rendezvous {rendezvous}",
            f"  precision  {p['mixed_precision']}"]


def format_report(report: dict) -> str:
    """The readable form of `collect()`'s report."""
    env, plan = report["launch_environment"], report["toolkit_launch"]
    lines = [f"versions     {_versions_line(report['versions'])}", f"devices      {_devices_line(report['devices'])}"]
    if env["launcher"] is not None:
        lines.append(f"launch env   {env['launcher']}, rank {env['rank']} of {env['world_size']}: engine `auto` picks "
                     f"{env['auto_engine']} ({env['auto_reason']})")
    if env["cluster"] is not None:
        cluster = env["cluster"]
        lines.append(f"cluster      {cluster['name']}: node {cluster['node_rank']} of {cluster['nodes']}")
    lines += _profile_lines(report["profile"])
    lines.append(f"toolkit launch  engine {plan['engine']} ({plan['engine_reason']}; --engine changes it), and "
                 f"`auto` in the script then picks {plan['engine']}")
    if plan["runs"] != plan["engine"]:
        lines.append(f"  runs       the {plan['runs']} engine (see the findings)")
    if plan["mesh"]:
        lines.append(f"  mesh       {' x '.join(f'{dim} {size}' for dim, size in plan['mesh'].items() if size > 1)}")
        lines += [f"  {label:<10} {text}" for label, text in mesh_story(plan["mesh"])]
    if plan["command"]:
        lines.append(f"  command    {plan['command']}")
    lines += [f"  note       {note}" for note in plan["notes"]]
    default = report["accelerate_default_config"]
    lines.append(f"accelerate default config {default['path']} ({'present' if default['exists'] else 'absent'})")
    findings = report["findings"]
    lines.append("findings" if findings else "findings     none")
    lines += [f"  {f['severity']}: {f['message']} [{f['code']}]" for f in findings]
    return "\n".join(lines)


def run_env(args) -> int:
    """Entry point of `toolkit env` (args from `toolkit.cli`)."""
    report = collect(args.config_file)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 1 if any(f["severity"] == "error" for f in report["findings"]) else 0
