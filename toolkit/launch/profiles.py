"""Accelerate YAML profiles, read by accelerate's own parser so its errors stay its own.

>>> profile = load_profile("accelerate_configs/multi_gpu.yaml")
>>> (profile.num_processes, profile.num_machines)
(2, 1)
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import UserError


@dataclass(frozen=True)
class Profile:
    """The topology and precision a profile asks for (the launcher's view of it)."""

    path: str
    distributed_type: str  # "NO", "MULTI_GPU", "MULTI_CPU", ...
    num_processes: int  # over all machines, as in accelerate
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int | None
    rdzv_backend: str
    gpu_ids: str | None  # "all", "0,1", or None
    mixed_precision: str
    use_cpu: bool
    dynamo_backend: str = "NO"  # the profile's dynamo_config: compile the model in prepare with this backend
    parallelism: bool = False  # the profile has Accelerate's parallelism_config keys (a device mesh)
    # The toolkit's pipeline keys in that parallelism_config (parallelism_config_pp_size, _pp_schedule,
    # _pp_microbatches), which accelerate launch does not hand over: toolkit launch does, as PARALLELISM_CONFIG_PP_*.
    pipeline: tuple = ()

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines


def load_profile(path: str) -> Profile:
    """Load and validate an accelerate profile; every problem becomes one UserError sentence."""
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        config = load_config_from_file(path)
    except FileNotFoundError:
        raise UserError(f"no accelerate profile at {path}; see accelerate_configs/ for the shipped ones.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UserError(f"{path} is not valid YAML{where}; fix the syntax or start from accelerate_configs/.") from None
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        raise UserError(f"accelerate rejected {path}: {' '.join(str(error).split())}") from None
    check_types(config, path)
    profile = Profile(
        path=path,
        distributed_type=str(getattr(config.distributed_type, "value", config.distributed_type)),
        num_processes=int(config.num_processes),
        num_machines=int(config.num_machines or 1),
        machine_rank=int(config.machine_rank or 0),
        main_process_ip=config.main_process_ip,
        main_process_port=None if config.main_process_port is None else int(config.main_process_port),
        rdzv_backend=config.rdzv_backend or "static",
        gpu_ids=None if config.gpu_ids is None else str(config.gpu_ids),
        mixed_precision=str(getattr(config.mixed_precision, "value", config.mixed_precision) or "no"),
        use_cpu=bool(config.use_cpu),
        dynamo_backend=str((getattr(config, "dynamo_config", None) or {}).get("dynamo_backend", "NO")).upper(),
        parallelism=bool(getattr(config, "parallelism_config", None)),
        pipeline=tuple((key[len("parallelism_config_"):].upper(), str(value)) for key, value
                       in (getattr(config, "parallelism_config", None) or {}).items()
                       if key in ("parallelism_config_pp_size", "parallelism_config_pp_schedule",
                                  "parallelism_config_pp_microbatches")),
    )
    check_profile(profile)
    return profile


def _whole(value) -> bool:
    return not isinstance(value, bool) and (isinstance(value, int) or isinstance(value, str)
                                            and value.strip().lstrip("-").isdigit())


def check_types(config, path: str):
    """Values of the wrong type, which accelerate's parser lets through: each would become a crash or, for
    `use_cpu: 'false'` (a true string), a silently different run."""
    from accelerate.utils import DistributedType

    for name, optional in (("num_processes", False), ("num_machines", True), ("machine_rank", True),
                           ("main_process_port", True)):
        value = getattr(config, name)
        if not (value is None and optional or _whole(value)):
            raise UserError(f"{path}: {name} must be a whole number, not {value!r}.")
    checks = {
        "distributed_type": ([t.value for t in DistributedType], "one of accelerate's distributed types"),
        "mixed_precision": ([None, "no", "fp16", "bf16", "fp8"], "no, fp16, bf16 or fp8"),
        "use_cpu": ([None, True, False], "true or false"),
    }
    for name, (allowed, what) in checks.items():
        value = getattr(config, name)
        value = getattr(value, "value", value)  # an enum of accelerate's
        if isinstance(value, (int, float)) and not isinstance(value, bool) or value not in allowed:  # 1 == True
            raise UserError(f"{path}: {name} must be {what}, not {value!r}.")
    if config.main_process_ip is not None and not isinstance(config.main_process_ip, str):
        raise UserError(f"{path}: main_process_ip must be a host name or address, not {config.main_process_ip!r}.")
    if config.gpu_ids is not None and not isinstance(config.gpu_ids, (str, int)):
        raise UserError(f"{path}: gpu_ids must be all or a list like 0,1, not {config.gpu_ids!r}.")


def check_profile(profile: Profile):
    """Topology mistakes accelerate itself lets through."""
    if profile.num_processes < 1:
        raise UserError(f"{profile.path}: num_processes must be at least 1, not {profile.num_processes}.")
    if profile.num_machines < 1:
        raise UserError(f"{profile.path}: num_machines must be at least 1, not {profile.num_machines}.")
    if profile.num_processes % profile.num_machines:
        raise UserError(
            f"{profile.path}: num_processes ({profile.num_processes}) must be a multiple of num_machines "
            f"({profile.num_machines}); it counts processes over all machines."
        )
    if not 0 <= profile.machine_rank < profile.num_machines:
        raise UserError(f"machine_rank {profile.machine_rank} is outside 0..{profile.num_machines - 1} for {profile.path}.")
    if profile.num_machines > 1 and not profile.main_process_ip:
        raise UserError(f"{profile.path}: a profile with several machines needs main_process_ip (the rank-0 host).")
    port = profile.main_process_port
    if port is not None and not 0 <= port <= 65535:
        raise UserError(f"{profile.path}: main_process_port {port} is outside 0..65535.")
    if profile.rdzv_backend not in ("static", "c10d"):
        raise UserError(f"{profile.path}: rdzv_backend must be static or c10d, not {profile.rdzv_backend!r}.")


def accelerate_environment(profile: Profile, fsdp: bool) -> dict[str, str]:
    """The variables `accelerate launch` hands its processes for a profile's dynamo_config (ACCELERATE_DYNAMO_*)
    and, with `fsdp`, for an FSDP profile's fsdp_config (ACCELERATE_USE_FSDP and FSDP_*) and its parallelism_config
    (ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_*), made by accelerate's own launch code, so that
    `toolkit launch` gives the plain engines what accelerate launch would give an Accelerator
    (toolkit/engines/compiling.py, fsdp_settings.py and parallelism.py read them). Empty where it asks for none."""
    mesh = fsdp and profile.parallelism
    fsdp = fsdp and profile.distributed_type == "FSDP"
    dynamo = profile.dynamo_backend != "NO"
    if not fsdp and not dynamo and not mesh:
        return {}
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    try:
        args = _validate_launch_command(launch_command_parser().parse_args(["--config_file", profile.path, "-"]))[0]
        variables = prepare_multi_gpu_env(args)
    except (ValueError, TypeError, KeyError) as error:
        raise UserError(f"accelerate rejected {profile.path}: {' '.join(str(error).split())}") from None
    return {**{k: v for k, v in variables.items()
               if fsdp and (k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP") or dynamo and k.startswith("ACCELERATE_DYNAMO_")
               or mesh and (k.startswith("PARALLELISM_CONFIG_") or k == "ACCELERATE_USE_PARALLELISM_CONFIG")},
            **({f"PARALLELISM_CONFIG_{key}": value for key, value in profile.pipeline} if mesh else {})}
