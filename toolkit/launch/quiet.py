"""Run `accelerate launch` or torchrun as `toolkit launch`'s child, reporting a failed worker in one line.

    python -m toolkit.launch.quiet torch.distributed.run --nproc_per_node 2 train.py
    python -m toolkit.launch.quiet accelerate.commands.launch --config_file cpu.yaml train.py

Both launchers are torchelastic agents: when a worker fails they log each step and then raise
ChildFailedError with a 20-line report and their own traceback. Under `toolkit launch` the worker has
already said why in one sentence (toolkit/errors.py), so this runs the same launcher in-process with its
logs silenced, and exits with the failing worker's own code (2 for a user error). A worker that failed
without saying why (a crash, a signal) gets one line naming its rank and exit code.

Ctrl-C (or SIGTERM) is one line and exit 130 (143) at any moment. The agent stops the workers with SIGTERM,
not the SIGINT it would forward: a worker still importing torch then ends without a KeyboardInterrupt
traceback, and one in its training loop (run_guard) saves at its next step and says `interrupted at step N`.
When no worker said that, this says the one line itself.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import tempfile
import threading

# Importing these creates the loggers that print the OMP_NUM_THREADS banner, "Sending process N closing
# signal" and "failed (exitcode: 2)" on every failure; the worker's own sentence is all the user needs.
_AGENT_MODULES = ("torch.distributed.run", "torch.distributed.launcher.api",
                  "torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


def silence_agent_logs():
    for module in _AGENT_MODULES:
        importlib.import_module(module)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def failure_code(failed) -> int:
    """The exit code `toolkit launch` returns for a ChildFailedError, printing one line unless a worker
    already said why (the error file it wrote tells, see toolkit/errors.py)."""
    failures = sorted(failed.failures.items(), key=lambda item: item[1].timestamp)
    said = [f for _, f in failures if f.error_file_data.get("toolkit_said")]
    if said:
        return said[0].exitcode
    for _, failure in failures:  # a rank that kept quiet for another that was ended before it could speak,
        # or for a rank on another node that said it there (each node says it once)
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else ""
        message = failure.error_file_data.get("peer_message") or message
        if message.startswith("error: "):
            print(message, file=sys.stderr, flush=True)
            return failure.exitcode
    rank, failure = failed.get_first_failure()
    why = f"signal {-failure.exitcode}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    print(f"error: rank {rank} stopped with {why} (its output above says why).", file=sys.stderr, flush=True)
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


STOP_NOTE = "TOOLKIT_STOP_NOTE"  # a file: a worker that stopped at a step boundary and said so writes its line there


def note_stop(line: str):
    """Called by a worker that stopped on Ctrl-C/SIGTERM at a step boundary and said `line`: its `toolkit launch`
    then adds nothing (torchelastic does not hand the launcher its workers' exit codes when it stops them)."""
    path = os.environ.get(STOP_NOTE)
    if path:
        try:
            with open(path, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass


def catch_signals(handler, signals=(signal.SIGINT, signal.SIGTERM)) -> dict:
    """Install `handler` for each of `signals`; returns the handlers it replaced, to restore. A SIGINT ignored on
    entry stays ignored, as POSIX has it: a shell starts a background job (`cmd &`, nohup) with SIGINT ignored,
    and the job must not then stop on a Ctrl-C meant for the foreground. Off the main thread (Ray Train runs the
    training function in a thread of its worker) nothing is installed: the host process owns the signals there."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in signals
            if not (sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN)}


def stopped_line(signum: int) -> str:
    """What `toolkit launch` says when a signal stopped the run before any worker said how far it got."""
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    return f"{how} before the run reached a step it saves at: nothing new was saved."


class Interrupted(BaseException):
    """Ctrl-C reached the launcher. A BaseException: nothing in the agent catches it, and its `finally` stops the
    workers with SIGTERM."""


def _interrupt(_signum, _frame):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # once: the agent is now stopping the workers
    raise Interrupted


def _stopped(signum: int, note: str) -> int:
    with open(note) as f:
        said = f.read().strip()
    if not said:
        print(stopped_line(signum), file=sys.stderr, flush=True)
    return 128 + signum


def main(argv: list[str]) -> int:
    catch_signals(_interrupt, (signal.SIGINT,))  # first: importing torch takes seconds
    # torchrun's --signals-to-handle (read from PET_SIGNALS_TO_HANDLE, also under accelerate launch): its handler
    # would forward SIGINT itself; it keeps SIGTERM, SIGHUP and SIGQUIT.
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", "SIGTERM,SIGHUP,SIGQUIT")
    fd, note = tempfile.mkstemp(prefix="toolkit-stop-")
    os.close(fd)
    os.environ[STOP_NOTE] = note  # the workers inherit it
    try:
        return _run_agent(argv, note)
    except Interrupted:
        return _stopped(signal.SIGINT, note)
    finally:
        os.unlink(note)


def _run_agent(argv: list[str], note: str) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    module, args = argv[0], argv[1:]
    silence_agent_logs()
    sys.argv = [module, *args]  # both launchers' main() parse sys.argv
    try:
        importlib.import_module(module).main()
    except ChildFailedError as failed:
        return failure_code(failed)
    except SignalException as stopped:  # SIGTERM: the agent stopped the workers, which said what they saved
        return _stopped(int(stopped.sigval), note)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 1
    return 0


def exit_now(code: int):
    """Leave without tearing down the interpreter (~0.7 s with torch loaded): the launcher has nothing left
    to clean up once its workers are gone, and every line it printed is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
