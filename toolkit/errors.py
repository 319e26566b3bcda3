"""Failures reported as one sentence and a non-zero exit code, never a traceback.

`UserError` (exit 2) is a mistake the user can fix; `RunFailure` (exit 1) is something that went wrong
while running (a dead peer, a non-finite loss) after which the checkpoints on disk are still good.
"""

import os
import sys


class RunFailure(Exception):
    """The run cannot go on (a peer died, the loss is not finite): one sentence, exit code 1."""

    exit_code = 1


class UserError(RunFailure):
    """A mistake the user can fix (bad flag, missing data, bad config): reported as one sentence, exit code 2."""

    exit_code = 2


def report(error: BaseException, stream=None) -> int:
    print(f"error: {error}", file=stream or sys.stderr, flush=True)
    return getattr(error, "exit_code", 1)


def install_excepthook():
    """Make an uncaught RunFailure print one line and exit with its code, in any script that builds an engine."""
    previous = sys.excepthook
    if getattr(previous, "_toolkit", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, RunFailure):
            # The real stderr: torch.distributed's own hook swaps sys.stderr for a buffer around ours.
            code = report(value, stream=sys.__stderr__)
            sys.stdout.flush()
            os._exit(code)  # skip interpreter teardown: a half-formed or broken process group can hang it
        previous(kind, value, traceback)

    hook._toolkit = True
    sys.excepthook = hook
