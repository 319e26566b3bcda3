"""User errors: one sentence and exit code 2, never a traceback."""

import os
import sys


class UserError(Exception):
    """A mistake the user can fix (bad flag, missing data, bad config): reported as one sentence, exit code 2."""


def report(error: BaseException, stream=None) -> int:
    print(f"error: {error}", file=stream or sys.stderr, flush=True)
    return 2


def install_excepthook():
    """Make an uncaught UserError print one line and exit 2, in any script that builds an engine."""
    previous = sys.excepthook
    if getattr(previous, "_toolkit", False):
        return

    def hook(kind, value, traceback):
        if isinstance(value, UserError):
            # The real stderr: torch.distributed's own hook swaps sys.stderr for a buffer around ours.
            report(value, stream=sys.__stderr__)
            sys.stdout.flush()
            os._exit(2)  # skip interpreter teardown: a half-formed process group can hang it
        previous(kind, value, traceback)

    hook._toolkit = True
    sys.excepthook = hook
