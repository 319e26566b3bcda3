"""Failures shared across ranks at one point, so that every rank stops together and the error is said once:
`settle` (every rank calls it), `all_ranks` (a block that may fail on some ranks only) and `main_process_first`
(the main process's turn, then the others'). Built on the engine's own `gather`; the sentence and exit code
are toolkit/errors.py's.
"""

from __future__ import annotations

import contextlib

from toolkit.errors import PeerFailure


def settle(engine, error: BaseException | None):
    """Every rank calls this at the same point: if any rank failed, all of them stop. The first failing
    rank raises its own error; the others raise a quiet PeerFailure with its exit code. This shares a
    failure before the next barrier instead of leaving the peers to time out or crash there."""
    if engine.num_processes > 1:
        import torch

        code = 0 if error is None else getattr(error, "exit_code", 1)
        codes = engine.gather(torch.tensor([code], device=engine.device)).tolist()
        failed = [rank for rank, c in enumerate(codes) if c]
        if failed and (error is None or engine.process_index != failed[0]):
            raise PeerFailure(codes[failed[0]], failed[0])
    if error is not None:
        raise error


@contextlib.contextmanager
def all_ranks(engine):
    """Run a block on every rank and stop them all if it fails on any (a file one rank cannot read).

    >>> from toolkit.engines import build_accelerator
    >>> with all_ranks(build_accelerator("single")):
    ...     pass
    """
    error = None
    try:
        yield
    except Exception as caught:  # a bug too: its peers must not wait for it at the next collective
        error = caught
    settle(engine, error)


@contextlib.contextmanager
def main_process_first(engine):
    """The main process runs the block first (one download), then the others; a failure on either side
    ends every rank, said once."""
    main = engine.is_main_process
    if not main:
        settle(engine, None)  # meets the main process after its turn; raises quietly if it failed
    error = None
    try:
        yield
    except Exception as caught:
        error = caught
    if main:
        settle(engine, error)
    settle(engine, None if main else error)
