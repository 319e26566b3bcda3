"""What stops a run cleanly, entered once around the loop: `with run_guard(run) as guard:`.

- Ctrl-C or SIGTERM asks the loop to stop at the next optimizer step, where the state is consistent: the
  recipe saves a checkpoint and `guard.stop_if_asked()` exits 130 (a second Ctrl-C stops at once);
- `guard.should_backward(loss)` gathers every rank's loss and stop flag (one small all-gather per micro-step,
  left on the device) and `guard.check()` reads it once backward is queued (the micro-step's one host sync),
  so all ranks agree: a NaN/inf loss stops the run in one sentence before its optimizer step; under
  --skip-nonfinite the loss must be read before backward, and a non-finite one skips that step on every rank;
- an error a collective raises because another rank died names that rank's own sentence when it published
  one (`rank 1 stopped: rank 0 failed: ...`, said by that rank, this one quiet with its exit code), else one
  sentence of its own (exit 1), never the transport error's text.
"""

from __future__ import annotations

import contextlib
import math
import signal

import torch

from toolkit.errors import RunFailure, first_failure
from toolkit.launch.quiet import catch_signals, note_stop


class StopRequest:
    """SIGINT/SIGTERM handlers that set `requested` (restored on exit); a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def _handle(self, signum, _frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self):
        self._previous = catch_signals(self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class RunGuard:
    def __init__(self, run, stop: StopRequest):
        self.run, self.accelerator, self._stop = run, run.accelerator, stop
        self.stop_requested = False  # any rank asked, as of the last check(): the same on every rank
        self.skipped_ranks: list[int] = []  # ranks whose loss was not finite in this optimizer step
        self._losses: list[torch.Tensor] = []  # every rank's loss of each micro-step of this optimizer step
        self._pending = None  # the last gathered (loss, stop) rows, not yet read

    def should_backward(self, loss) -> bool:
        """Gather every rank's `loss` (and stop flag) on the device; False only under --skip-nonfinite when some
        rank's loss is not finite (every rank then skips the step's backward)."""
        if self.run.step + 1 == self.run.env.debug_nan_step and self.accelerator.is_main_process:  # tests' NaN
            loss = loss * float("nan")
        mine = torch.stack([loss.detach().float().reshape(()),
                            torch.tensor(float(self._stop.requested), device=loss.device)]).unsqueeze(0)
        self._pending = self.accelerator.gather(mine)  # world x (loss, asked to stop)
        if not self.run.cfg.skip_nonfinite:
            return True  # read by check() once backward is queued: the host does not wait for the forward
        return not self.check()

    def check(self) -> list[int]:
        """Read the gathered losses (the host sync), the same on every rank; a non-finite one is a RunFailure
        naming the ranks unless --skip-nonfinite. Returns the ranks whose loss is not finite."""
        if self._pending is None:
            return []
        rows, self._pending = self._pending.tolist(), None
        losses = [row[0] for row in rows]
        bad = [rank for rank, value in enumerate(losses) if not math.isfinite(value)]
        self.stop_requested = self.stop_requested or any(row[1] for row in rows)
        if bad and not self.run.cfg.skip_nonfinite:
            step = self.run.step + 1
            raise RunFailure(f"the loss is not finite at step {step} on rank(s) {bad}; stopped with the checkpoints "
                             f"of step {step - 1} and before intact (--skip-nonfinite skips such steps).")
        self.skipped_ranks = sorted(set(self.skipped_ranks) | set(bad))
        self._losses.append(torch.tensor(losses))
        return bad

    def step_done(self) -> dict:
        """{"loss": the mean over every rank and micro-step of the optimizer step just done (the global batch's
        loss, whatever its split: micro-batches are of equal size), "skipped_ranks" when some were}; then reset."""
        done = {"loss": torch.cat(self._losses).mean().item() if self._losses else float("nan")}
        if self.skipped_ranks:
            done["skipped_ranks"] = self.skipped_ranks
        self._losses, self.skipped_ranks = [], []
        return done

    def stop_if_asked(self):
        """After the step's checkpoint: exit 130 on every rank when any rank was asked to stop."""
        if self.stop_requested:
            line = f"interrupted at step {self.run.step}: checkpoint saved; resume with --resume auto"
            self.run.say(line)
            note_stop(line)  # every rank: toolkit launch then adds no line of its own, on any node
            raise SystemExit(130)


@contextlib.contextmanager
def run_guard(run):
    """Signals handled, a lost peer said in one sentence, and the run's progress bar closed on the way out."""
    with StopRequest() as stop:
        try:
            yield RunGuard(run, stop)
        except Exception as error:
            if is_peer_failure(error):
                # The failing rank publishes its sentence before it exits, and its exit is what broke ours.
                raise first_failure(wait=1.0) or RunFailure(
                    peer_failure_message(run, run.cfg.timeout)) from None
            raise
        finally:
            run.close_progress()


def is_peer_failure(error: BaseException) -> bool:
    """True for the errors a collective raises when another rank died or stopped answering."""
    import torch.distributed as dist

    if isinstance(error, (dist.DistBackendError, dist.DistNetworkError)):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                            "Broken pipe", "NCCL communicator was aborted", "ProcessGroupGloo"))


def peer_failure_message(run, timeout: float) -> str:
    """A peer gone without a word (killed, frozen, crashed in C++): the transport's own error text only names
    a socket, so it is left out."""
    env, accelerator, step = run.env, run.accelerator, run.step
    then = ("the launcher restarts the group from the latest checkpoint" if env.restart_count < env.max_restarts
            else "checkpoints on disk are intact, relaunch with --resume auto")
    return (f"rank {accelerator.process_index} lost contact with the other ranks at step {step}: a peer died or did "
            f"not answer within {timeout:g} s; {then}.")
