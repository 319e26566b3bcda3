"""What a run resumes from: `Resume`, the answer of `TrainingRun.resume_folder`, and the load of a checkpoint
folder that was saved without the run's own objects (a plain `accelerator.save_state`, `save_checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import UserError
from toolkit.checkpoint.functional import load_checkpoint
from toolkit.checkpoint.state import saved_schedule

ACTIONS = ("start", "load_state", "loaded", "finished")


@dataclass(frozen=True)
class Resume:
    """What `TrainingRun.resume_folder` found and did, one of ACTIONS:

    - "start": nothing to resume; the run starts at step 0;
    - "load_state": `folder` holds the state of every object registered for checkpointing, the run's position
      among them: pass it to `accelerator.load_state`;
    - "loaded": `folder` was saved without them; its weights, optimizer state and schedule were loaded into the
      objects given, the position taken from its state.json or its schedule's count;
    - "finished": `folder` is the last step of a run whose summary.json reports that step (`run.finished`):
      nothing is loaded, trained or rewritten.
    """

    action: str
    folder: Path | None = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"a resume's action is one of {', '.join(ACTIONS)}, not {self.action!r}")


def load_weights_and_schedule(path: Path, accelerator, model, optimizer, scheduler) -> bool:
    """Load `path`'s model weights and optimizer state into the prepared `model` and `optimizer`, and its
    schedule into `scheduler` when both exist; returns whether a schedule was loaded. Another optimizer's or
    schedule's state is one sentence."""
    try:
        load_checkpoint(path, model=accelerator.unwrap_model(model, keep_torch_compile=False), optimizer=optimizer,
                        scaler=getattr(accelerator, "scaler", None))
        schedule = saved_schedule(path)
        if scheduler is not None and schedule is not None:
            scheduler.load_state_dict(schedule)
    except ValueError as error:  # torch's optimizer/scheduler refusal: another optimizer's state
        raise UserError(f"{path} holds an optimizer or scheduler state this recipe's cannot take ({error}); "
                        f"resume from a checkpoint of this recipe or start in a fresh --output-dir.") from None
    return scheduler is not None and schedule is not None


def schedule_among(checkpointed) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate schedule among the objects registered for checkpointing, None when there is none."""
    return next((o for o in checkpointed if isinstance(o, torch.optim.lr_scheduler.LRScheduler)), None)
