"""The engine factory: the only place that chooses between engines.

The engines and their properties are rows of toolkit/launch/engine_specs.py. Which engine runs, in order of
precedence:
1. `build_accelerator(engine=...)` when it is not "auto";
2. the TOOLKIT_ENGINE environment variable (`toolkit launch --engine E` sets it for its children);
3. "auto", from how the process was launched: `accelerate launch` -> accelerate; torchrun, the legacy
   torch.distributed.launch, toolkit.spawn, srun and mpirun -> ddp (fsdp when the script gives an `fsdp_plugin`, as
   Accelerate then shards); plain `python` -> single.
An engine asked for FSDP (an FSDP profile, or `fsdp_plugin=`) where it cannot shard without CUDA (accelerate) becomes
the engine its row names instead (fsdp), with a one-line notice: accelerate itself would train DDP without a word.
"""

from __future__ import annotations

import importlib

from toolkit.engines.workers import freeze_what_is_loaded
from toolkit.errors import UserError, install_excepthook
from toolkit.launch.clusters import alone_under
from toolkit.launch.engine_specs import AUTO_BY_LAUNCHER, ENGINE_SPECS
from toolkit.launch.env import LaunchEnv, Threads, read_launch_env, threads_per_process

# name -> "module:Class", imported lazily so that choosing ddp never imports accelerate.
ENGINES = {name: spec.builds for name, spec in ENGINE_SPECS.items()}


# Accelerate 1.16 turns FSDP on only for GPU-type states: on CPU (no CUDA, or use_cpu) it trains plain DDP.
FSDP_WITHOUT_CUDA = ("accelerate runs FSDP only on GPUs (here it would train plain DDP): this FSDP profile trains "
                     "with the toolkit's fsdp engine instead (FSDP2 over gloo).")


def accelerate_drops_fsdp(use_cpu: bool = False) -> bool:
    """True where accelerate would quietly replace an FSDP profile's sharding by DDP."""
    import torch

    return bool(use_cpu) or not torch.cuda.is_available()


def resolve_engine(engine: str | None, env: LaunchEnv) -> str:
    """The engine name that `build_accelerator(engine)` would use in this environment."""
    name = engine if engine not in (None, "", "auto") else (env.engine or "auto")
    if name == "auto":
        name = AUTO_BY_LAUNCHER[env.launcher]
    if name not in ENGINES:
        raise UserError(f"unknown engine {name!r}; choose one of auto, {', '.join(ENGINES)}.")
    return name


def mesh_sizes(accelerator) -> dict | None:
    """The device mesh's dimensions and sizes ({"dp_shard": 2, "tp": 2}), or None without one."""
    mesh = getattr(accelerator, "torch_device_mesh", None)
    return None if mesh is None else dict(zip(mesh.mesh_dim_names, mesh.shape))


def engine_name(accelerator) -> str:
    """Which engine `accelerator` is: a toolkit engine's `name`, "accelerate" for Accelerate's own Accelerator,
    which the training parts (toolkit/train) work over as well.

    >>> engine_name(build_accelerator("single")), engine_name(object())
    ('single', 'accelerate')
    """
    return getattr(accelerator, "name", "accelerate")


def build_accelerator(engine: str = "auto", **kwargs):
    """Build the engine for this process. kwargs are Accelerator's own (mixed_precision,
    gradient_accumulation_steps, ...) plus `timeout` (seconds) for collectives.

    >>> accelerator = build_accelerator("single")
    >>> accelerator.num_processes
    1

    `accelerator.threads` says how many intra-op threads each process runs, and why (`set_threads`).
    """
    install_excepthook()  # before reading the environment: contradicting cluster variables are one sentence
    env = read_launch_env()
    freeze_what_is_loaded()
    alone = alone_under(env.cluster, env.launcher, env.world_size)
    if alone:
        raise UserError(alone)
    if env.accelerate_lost_processes:
        raise UserError(
            "accelerate launch was asked for several processes but started only this one (a MULTI_CPU profile "
            "needs mpirun); use `toolkit launch` or a profile with distributed_type MULTI_GPU."
        )
    if env.num_nodes > 1 and not env.gloo_socket_ifname:
        # gloo would bind to whatever this host's name resolves to (often 127.0.0.1) and hand that to the
        # other machines; the interface that routes to the main node is the one they can reach.
        from toolkit.launch.rendezvous import pin_gloo_interface

        pin_gloo_interface(env.master_addr)
    name = resolve_engine(engine, env)
    sharding = kwargs.get("fsdp_plugin") is not None or kwargs.get("parallelism_config") is not None
    if name == "ddp" and sharding and engine in (None, "", "auto") and not env.engine:
        name = "fsdp"  # chosen by the launcher alone: Accelerate shards a model whose script gives a plugin or mesh
    spec = ENGINE_SPECS[name]
    # A profile, or the script's plugin or mesh.
    asks_fsdp = env.accelerate_fsdp or bool(env.parallelism_sizes) or sharding
    if spec.fsdp_without_cuda and asks_fsdp and accelerate_drops_fsdp(env.use_cpu or kwargs.get("cpu")):
        if env.rank == 0:
            print(f"[toolkit] {FSDP_WITHOUT_CUDA}", flush=True)
        spec = ENGINE_SPECS[spec.fsdp_without_cuda]
    module_name, class_name = spec.builds.split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    built = engine_class(env, **kwargs)
    # After the engine: without OMP_NUM_THREADS, Accelerate's CPU ranks set physical cores / local processes.
    built.threads = set_threads(env)
    check_world(built, env)
    if not spec.accelerator:  # a real Accelerator keeps its own state
        from toolkit.engines.accelerate_settings import share_state_with_accelerate

        share_state_with_accelerate(built)
    return built


def set_threads(env: LaunchEnv) -> Threads:
    """Set torch's intra-op threads for this process by the rule of `threads_per_process` (the cores it may run
    on over the processes of its machine, or OMP_NUM_THREADS) and return the count with its reason. It holds
    on GPU ranks too, for the work they do on the CPU."""
    import torch

    threads = threads_per_process(env, current=torch.get_num_threads())
    if torch.get_num_threads() != threads.count:
        torch.set_num_threads(threads.count)
    return threads


def check_world(engine, env: LaunchEnv):
    """Refuse to train when the group that formed is not the world the launcher announced."""
    if engine.num_processes != env.world_size:
        raise UserError(
            f"the launcher started {env.world_size} processes but the {engine.name} engine formed a group of "
            f"{engine.num_processes}: the ranks would train independently; check the profile and the launcher."
        )
    if env.world_size > 1:
        import torch

        mine = torch.tensor([engine.process_index, engine.num_processes], device=engine.device)
        views = engine.gather(mine.unsqueeze(0)).tolist()
        ranks, worlds = sorted(v[0] for v in views), {v[1] for v in views}
        if ranks != list(range(env.world_size)) or worlds != {env.world_size}:
            raise UserError(f"the ranks disagree about the world (rank, size per process: {views}); relaunch all of them.")
