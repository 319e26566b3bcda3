"""What a resume changes: the checkpoint's config (saved in every state.json) against the one the resumed run
was started with. Where the run goes (engine, world size, micro-batch, output and data paths) and what it
records may change freely; a value that changes the math (the schedule's length, lr, global batch, precision,
seed, data, augmentation, classes) is refused unless --allow-config-change, so a resume never trains a
different run without saying so.

    >>> saved = {"model": "tiny", "epochs": 3, "lr": 0.04, "engine": "ddp", "mixed_precision": "bf16"}
    >>> now = {"model": "tiny", "epochs": 5, "lr": 0.04, "engine": "fsdp", "mixed_precision": "no", "resume": "auto"}
    >>> for change in config_changes(saved, now):
    ...     print(change.changes_math, change)
    True --epochs 5 (the checkpoint's run: 3)
    False --engine fsdp (the checkpoint's run: ddp)
    True mixed precision no (the checkpoint's run: bf16)
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.config import listing

# Where the run goes and what it records: a resume may change these and the math stays the same (a world size
# or engine switch is the toolkit's promise; a moved data folder still holds the same data, and the classes
# are compared on their own).
FREE = {"engine", "micro_batch_size", "timeout", "log_with", "keep", "checkpoint_every", "eval_every",
        "checkpoint_format", "workers", "compile", "channels_last", "skip_nonfinite", "data_dir", "weights",
        "activation_checkpointing", "keep_best", "peak_tflops", "profile_steps", "memory"}
# Not compared: how this run was started and where its folder is now, not what it trains.
IGNORED = {"resume", "allow_config_change", "output_dir", "print_config"}
NAMES = {"mixed_precision": "mixed precision", "classes": "classes"}


@dataclass(frozen=True)
class Change:
    key: str
    now: object
    saved: object

    @property
    def changes_math(self) -> bool:
        return self.key not in FREE

    def __str__(self):
        name = NAMES.get(self.key, "--" + self.key.replace("_", "-"))
        return f"{name} {shown(self.now)} (the checkpoint's run: {shown(self.saved)})"


def shown(value, limit: int = 4) -> str:
    """A value as a message shows it: lists cut to `limit` items with how many more."""
    if value is None:
        return "unset"
    if isinstance(value, (list, tuple)):
        return f"[{listing(value, limit)}]"
    return str(value)


def config_changes(saved: dict, now: dict) -> list[Change]:
    """Every key whose value differs between the checkpoint's config `saved` and this run's `now`, in `now`'s
    order. A key the checkpoint did not record is not a change (an older toolkit's; it saved the
    --mixed-precision flag, None for "the profile's", where it now saves the precision the run used)."""
    unknown = {key for key, value in saved.items() if value is None and key == "mixed_precision"}
    return [Change(key, value, saved[key]) for key, value in now.items()
            if key in saved and key not in IGNORED | unknown and saved[key] != value
            and not (isinstance(value, tuple) and list(value) == saved[key])]
