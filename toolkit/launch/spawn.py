"""The third way to launch, beside torchrun and `accelerate launch`: torch.multiprocessing from a plain script
or a notebook. Each worker gets the launch environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) plus TOOLKIT_LAUNCHER=spawn, so `build_accelerator()` inside it forms the group as usual.

    import toolkit

    def train(lr):
        accelerator = toolkit.build_accelerator()     # ddp engine, rank 0 or 1 of 2
        ...

    toolkit.spawn(train, 2, 0.1)                      # returns when both workers have finished

It says once where the workers run (`toolkit.spawn: 2 processes on CPU (gloo)`), and a worker's error is one
sentence naming the rank that failed first; the others are stopped without a word.
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import sys
import tempfile
import time

from toolkit.errors import RunFailure, UserError, install_excepthook

STOP_GRACE_S = 10  # a stopped worker's SIGTERM handler (run_guard's) gets this long before SIGKILL


def _worker(index: int, fn, num_processes: int, port: int, forked: bool, args: tuple, reports: str):
    # Runs in the child: the parent's environment is untouched.
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(num_processes),
                      LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TOOLKIT_LAUNCHER="spawn")
    if forked or num_processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # One thread per worker, as torchrun gives each of several workers. A forked worker must: the OpenMP
        # pool its parent (a notebook that already ran a matmul) started does not survive the fork, and the
        # worker's first parallel op would wait for it forever.
        torch.set_num_threads(1)
    try:
        fn(*args)
        _leave_group()
    except Exception as error:  # KeyboardInterrupt: torch's wrapper ends the worker quietly
        _report_failure(reports, index, error)
        return
    _exit_done(forked)


def _leave_group():
    """After `fn` returned on every rank, close the process group it left open: a worker whose gloo threads (and
    the fsdp engine's device mesh) outlive it is aborted at exit ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _exit_done(forked: bool):
    """End a worker whose `fn` returned: its own Python exit handlers run (a forked worker's are its parent's, which
    multiprocessing never runs in a child) and the streams are flushed, then the process ends without the C++
    runtime's teardown, where a thread that torch's collectives leave joinable can abort a finished fsdp worker
    (signal 6) even after its group is closed."""
    import atexit

    if not forked:
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _report_failure(reports: str, index: int, error: Exception):
    """Leave the parent this worker's sentence, then exit at once: tearing down an interpreter whose process
    group's threads still run can abort it ("terminate called without an active exception")."""
    if getattr(error, "quiet", False):  # it stopped because another worker failed: that one's report says why
        os._exit(1)
    text = str(error) if isinstance(error, RunFailure) else f"{type(error).__name__}: {error}"
    sentence = next((line.strip() for line in text.splitlines() if line.strip()), text)
    report = {"time": time.time(), "sentence": sentence, "user_error": isinstance(error, UserError)}
    with open(os.path.join(reports, f"{index}.json"), "w") as f:
        json.dump(report, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _default_start_method() -> str:
    # A function defined in a notebook cell cannot be pickled for "spawn"; fork copies it (as Accelerate's
    # notebook_launcher does). A script's functions are importable, and "spawn" avoids forking live threads.
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return "spawn" if main_file and os.path.isfile(main_file) else "fork"  # `python -c`, `python - < x`: fork


def devices(num_processes: int, environ=os.environ) -> str:
    """Where `build_accelerator()` in the workers will compute: "CPU (gloo)" or "CUDA GPUs 0, 1 (nccl)".
    torch.cuda.device_count() asks NVML, so a notebook can still fork CUDA workers afterwards.

    >>> devices(2, environ={"ACCELERATE_USE_CPU": "true"})
    'CPU (gloo)'
    """
    import torch

    from toolkit.launch.env import cpu_profile

    gpus = 0 if cpu_profile(environ) else torch.cuda.device_count()
    if gpus == 0:
        return "CPU (gloo)" if num_processes > 1 else "CPU"
    ids = list(range(num_processes)) if gpus > 1 else [0]  # one visible GPU: every worker's (as the ddp engine)
    named = f"CUDA GPU{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
    return named + (" (nccl)" if num_processes > 1 else "")


def spawn(fn, num_processes: int, *args, start_method: str | None = None):
    """Run `fn(*args)` in `num_processes` worker processes on this machine and wait for all of them.

    A worker that raises becomes one sentence naming its rank and error (RunFailure, exit 1 from a script;
    a UserError stays one, exit 2); the others are stopped.
    """
    import torch.multiprocessing as mp

    from toolkit.launch.launcher import free_port

    install_excepthook()  # a script that calls spawn gets the one sentence, not a traceback
    if num_processes < 1:
        raise UserError(f"toolkit.spawn needs at least 1 process, not {num_processes}.")
    method = start_method or _default_start_method()
    print(f"toolkit.spawn: {num_processes} process{'es' if num_processes > 1 else ''} on {devices(num_processes)}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="toolkit-spawn-") as reports:
        # torch's own join logs "Terminating process N via signal SIGTERM" for every worker it stops: waited here.
        context = mp.start_processes(_worker, args=(fn, num_processes, free_port(), method == "fork", args, reports),
                                     nprocs=num_processes, start_method=method, join=False)
        try:
            failed = _wait(context.processes)
        finally:
            _stop(context.processes)
        if failed is not None:
            raise _failure(failed, context.processes[failed].exitcode, reports)


def _wait(processes) -> int | None:
    """Wait until every worker ended well (None) or one failed (its index)."""
    running = {process.sentinel: index for index, process in enumerate(processes)}
    while running:
        for sentinel in multiprocessing.connection.wait(list(running)):
            index = running.pop(sentinel)
            processes[index].join()
            if processes[index].exitcode != 0:
                return index
    return None


def _stop(processes):
    """SIGTERM the workers still running (a training loop stops at its next step), SIGKILL those that linger."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def _failure(index: int, exitcode: int, reports: str) -> RunFailure:
    """The first failure any worker reported (a peer whose collective broke reports later), else the exit of
    worker `index`."""
    found = []
    for name in os.listdir(reports):
        with open(os.path.join(reports, name)) as f:
            found.append((json.load(f), int(name.split(".")[0])))
    if found:
        report, rank = min(found, key=lambda item: item[0]["time"])
        kind = UserError if report["user_error"] else RunFailure
        return kind(f"toolkit.spawn: rank {rank} failed: {report['sentence']}")
    if exitcode < 0:
        return RunFailure(f"toolkit.spawn: rank {index} was killed by signal {-exitcode} before finishing.")
    return RunFailure(f"toolkit.spawn: rank {index} exited with code {exitcode} before finishing (killed, or it "
                      "called sys.exit).")
