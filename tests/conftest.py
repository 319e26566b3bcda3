"""Shared helpers: run real processes with a clean launch environment and a hard time limit."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import safetensors.torch

from toolkit.engines.workers import freeze_what_is_loaded

from machine_share import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401 (hooks)

ROOT = Path(__file__).resolve().parent.parent
# The plan's measurement of this machine (toolkit/plan/device.py) is cached per suite run, not read from the user's
# ~/.cache: a recipe run predicts its step time only where a test measured the machine first.
os.environ.setdefault("TOOLKIT_CACHE", tempfile.mkdtemp(prefix="toolkit-cache-"))
SCRIPTS = ROOT / "tests" / "scripts"
CONFIGS = ROOT / "accelerate_configs"
# Variables a launcher leaves behind would make a child think it is a rank of some other job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RUN_ID", "TOOLKIT_ENGINE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND",
               "ACCELERATE_USE_CPU", "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
               "CUDA_VISIBLE_DEVICES", "TOOLKIT_PARITY_DIR", "TOOLKIT_PARITY_STEPS", "GLOO_SOCKET_IFNAME")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    # PYTHONFAULTHANDLER: a child killed by a fatal signal (SIGSEGV, SIGABRT) prints each thread's Python stack
    # first, so a failure says where it happened.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": "",
                "PYTHONFAULTHANDLER": "1"})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def as_a_terminal_starts_it():
    """preexec_fn for a child that a test sends SIGINT: SIGINT's default disposition, as a terminal's foreground job
    has it. A suite run as a background job (`pytest &`, `nohup`) has SIGINT ignored, its children inherit that,
    and a program rightly leaves an ignored SIGINT ignored: the test would then decide nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(cmd, timeout=180, check=True, cwd=ROOT, **env):
    """Run `cmd` (list), return CompletedProcess with text output; fail the test on a non-zero exit."""
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=clean_env(**env), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        fatal = proc.stderr.find("Fatal Python error")  # a fatal signal's stacks, above a launcher's summary
        stacks = f"{proc.stderr[fatal:fatal + 4000]}\n...\n" if fatal >= 0 else ""
        pytest.fail(f"{' '.join(map(str, cmd))} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-3000:]}\n"
                    f"STDERR:\n{stacks}{proc.stderr[-5000:]}")
    return proc


def final_weights(out, steps=None):
    """The model weights of OUT's latest checkpoint, which must be that of step `steps` when given."""
    from toolkit.checkpoint.functional import latest_checkpoint

    checkpoint = latest_checkpoint(Path(out) / "checkpoints")
    assert checkpoint is not None and (steps is None or checkpoint.name == f"step-{steps:08d}"), checkpoint
    return safetensors.torch.load_file(checkpoint / "model.safetensors")


def max_weight_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def kill_groups(procs):
    """SIGKILL each process, its descendants (torchrun starts workers in sessions of their own) and its
    group (started with start_new_session=True), even when the leader has already exited: a stopped or
    orphaned worker would otherwise outlive the test."""
    import psutil

    for proc in procs:
        try:
            descendants = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for process in descendants:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def read_json(path):
    with open(path) as f:
        return json.load(f)


PY = sys.executable
# Every pytest process (the workers, and the pytest each mutation case starts) has torch loaded: its collector
# skips torch's objects from here on, and it leaves without the shutdown collections, as a training process does.
freeze_what_is_loaded()
TORCHRUN = [PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1"]
ACCELERATE = [PY, "-m", "accelerate.commands.launch"]
TOOLKIT = [PY, "-m", "toolkit.cli"]


@pytest.fixture(autouse=True, scope="module")
def forget_accelerate_state():
    """A real Accelerator leaves Accelerate's process-wide state behind; under pytest-xdist one worker runs several
    files, and a later file's `notebook_launcher` refuses to start while any exists. Each file starts without it."""
    yield
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def cpu_fsdp_profile(processes: int, extra: str) -> str:
    """An FSDP profile's YAML for CPU processes on this machine, with `extra` (its fsdp_config and more) after."""
    return (f"compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nuse_cpu: true\nnum_processes: {processes}\n"
            "num_machines: 1\nmachine_rank: 0\nmain_process_port: 0\nmixed_precision: 'no'\n" + textwrap.dedent(extra))
