"""Failures reported as one sentence and a non-zero exit code, never a traceback, under every launcher.

`UserError` (exit 2) is a mistake the user can fix; `RunFailure` (exit 1) is something that went wrong
while running (a dead peer, a non-finite loss) after which the checkpoints on disk are still good.

With several processes the sentence is said once: the first rank that fails says it and publishes it in the
job's rendezvous store; the others learn of it there (or through `settle` in toolkit/engines/collectives.py)
and exit with the same code without a word, their launcher report reading `rank 1 stopped: rank 0 failed:
<its sentence>`. Before the process group exists, only each node's local rank 0 speaks: every rank checks the
same flags and would say the same thing.
"""

from __future__ import annotations

import json
import os
import sys
import time


class RunFailure(Exception):
    """The run cannot go on (a peer died, the loss is not finite): one sentence, exit code 1."""

    exit_code = 1
    quiet = False  # True: another rank says why; this one only exits


class UserError(RunFailure):
    """A mistake the user can fix (bad flag, missing data, bad config): reported as one sentence, exit code 2."""

    exit_code = 2


class PeerFailure(RunFailure):
    """Another rank failed and says why; this rank stops quietly with the same exit code. With the first
    failing rank's sentence (`sentence`) it reads `rank 1 stopped: rank 0 failed: <sentence>`."""

    quiet = True

    def __init__(self, exit_code: int, rank: int | None = None, sentence: str | None = None):
        who = "another rank" if rank is None else f"rank {rank}"
        if sentence:
            super().__init__(f"rank {_own_rank()} stopped: {who} failed: {sentence}")
        else:
            super().__init__(f"stopped because {who} failed first (exit code {exit_code}); its error says why")
        self.exit_code, self.rank, self.sentence = exit_code, rank, sentence


def report(error: BaseException, stream=None, own_line: bool = False) -> int:
    """Print `error` as one sentence; `own_line` starts it on a new line (another process's progress bar may end
    the line). Returns its exit code."""
    stream = stream or sys.stderr
    line = ("\n" if own_line else "") + f"error: {error}"
    if "tqdm" in sys.modules:  # a progress bar of this process still on the line: tqdm moves it out of the way
        from tqdm import tqdm

        with tqdm.external_write_mode(file=stream):
            print(line, file=stream, flush=True)
    else:
        print(line, file=stream, flush=True)
    return getattr(error, "exit_code", 1)


def _failure_key() -> str:
    return f"toolkit/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store():
    """The job's rendezvous store when a process group is up (torchrun's agent hosts it), else None."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            import datetime

            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(datetime.timedelta(seconds=5))
            return store
    except Exception:  # a group torn down half-way: fall back to the local rule
        return None
    return None


def _own_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK") or 0)


def claim_first(sentence: str, exit_code: int) -> bool | None:
    """Record `sentence` as the job's first failure unless another rank did: True when this rank is the first,
    False when it is not, None without a store (no process group). Peers whose collective then breaks read it
    (`first_failure`) instead of quoting the transport error."""
    store = _store()
    if store is None:
        return None
    try:
        if store.add(_failure_key() + "/count", 1) != 1:
            return False
        # The message and rank before the code: a rank that sees the code may look for them (other nodes print it).
        store.set(_failure_key() + "/message", f"error: {sentence}")
        store.set(_failure_key() + "/rank", str(_own_rank()))
        store.set(_failure_key() + "/code", str(exit_code))
        return True
    except Exception:
        return None


def speaks(error: RunFailure) -> bool:
    """Whether this process prints `error`: not when quiet, and once per job (or per node before the
    process group exists: every rank then checks the same flags, and local rank 0 says it)."""
    if error.quiet:
        return False
    first = claim_first(str(error), error.exit_code)
    if first is not None:
        return first
    return os.environ.get("LOCAL_RANK", "0") in ("", "0")


def first_failure(wait: float = 0.0) -> PeerFailure | None:
    """The failure the first failing rank recorded in the job's store (waiting up to `wait` s for it), as this
    rank's quiet PeerFailure naming that rank and its sentence; None when no rank recorded one."""
    store = _store()
    if store is None:
        return None
    try:
        import datetime

        key = _failure_key()
        if wait > 0:
            store.wait([key + "/code"], datetime.timedelta(seconds=wait))
        if not store.check([key + "/code"]):
            return None
        message = store.get(key + "/message").decode()
        return PeerFailure(int(store.get(key + "/code")), int(store.get(key + "/rank")),
                           message[len("error: "):] if message.startswith("error: ") else message)
    except Exception:  # it died before saying anything, or its store is gone
        return None


def write_error_file(error: RunFailure, said: bool):
    """torchelastic's reply file: plain torchrun and accelerate launch then show our sentence as the root
    cause in their summary, instead of a pointer to its docs. The root cause is the earliest failure, so a
    rank that did not print dates its own a little later than the one that did."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    if error.quiet and not getattr(error, "sentence", None):
        # `settle` raised it the moment it saw the code: the first rank may still be publishing its sentence
        error = first_failure(wait=3.0) or error
    message = str(error) if error.quiet else f"error: {error}"
    stamp = int(time.time()) + (0 if said else 2)
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(stamp)}},
            "toolkit_said": said}  # toolkit.launch.quiet prints the sentence when no rank did
    if error.quiet:  # on another node than the rank that said it, toolkit launch repeats it once for this node
        sentence = getattr(error, "sentence", None)
        data["peer_message"] = f"error: {sentence}" if sentence else None
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def say(error: RunFailure, own_line: bool = False) -> bool:
    """Print `error` if this rank is the one to say it (see `speaks`); True when it did."""
    said = speaks(error)
    if said:
        # The real stderr: torch.distributed's own hook swaps sys.stderr for a buffer around ours.
        report(error, stream=sys.__stderr__, own_line=own_line)
    return said


def exit_for(error: RunFailure, own_line: bool = False):
    """Say `error` (if this rank is the one to say it), then leave at once with its code."""
    said = say(error, own_line)
    write_error_file(error, said)
    sys.stdout.flush()
    if not said and not error.quiet:
        # Before the process group every rank checks the same flags and local rank 0 says it; the launcher
        # ends all ranks as soon as one exits, so give it time to print first, on a loaded machine too (the
        # wait ends as soon as local rank 0 exits: the launcher then stops this rank).
        time.sleep(5)
    os._exit(error.exit_code)  # skip interpreter teardown: a half-formed or broken process group can hang it


def install_excepthook(own_line: bool = False):
    """Make an uncaught RunFailure print one line (once per job) and exit with its code, in any script that
    builds an engine; a collective broken because a peer already failed ends this rank quietly. `own_line`
    (a non-main rank of a multi-process run, where the main process may draw a progress bar) starts the
    sentence on a new line; once asked, it stays."""
    hook = sys.excepthook
    if not getattr(hook, "_toolkit", False):
        previous = hook

        def hook(kind, value, traceback):
            if isinstance(value, RunFailure):
                exit_for(value, hook.own_line)
            failure = first_failure()
            if failure is not None:  # our collective broke because that peer left: it has said why
                exit_for(failure, hook.own_line)
            if issubclass(kind, Exception):  # a bug: its traceback follows; the peers its exit cuts off name it
                claim_first(f"{kind.__name__}: {value} (its traceback is in its output)", 1)
            previous(kind, value, traceback)

        hook._toolkit, hook.own_line = True, False
        sys.excepthook = hook
    hook.own_line = hook.own_line or own_line
