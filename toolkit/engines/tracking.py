"""Experiment trackers with Accelerate's semantics, for the engines that do not import accelerate.

`Accelerator(log_with=..., project_dir=...)`, `init_trackers`, `log`, `get_tracker` and `end_training` map onto
`check_trackers` (at construction, every rank), `build_trackers` (main process), each tracker's `log`,
`find_tracker` and each tracker's `finish`. The trackers have Accelerate's `GeneralTracker` shape (`name`,
`requires_logging_directory`, `tracker`, `start`, `store_init_configuration`, `log`, `finish`) and its
constructor convention (`cls(project_name, logging_dir, **init_kwargs)` when they need a folder), so the jsonl
and csv ones also run inside a real Accelerator (`for_accelerate`) and write the same files there.

Files land where Accelerate puts them: `<logging_dir>/<project_name>/` (logging_dir is project_dir unless a
ProjectConfiguration says otherwise). Nothing here imports accelerate until `for_accelerate` is called.
"""

from __future__ import annotations

import enum
import importlib.util

from toolkit.errors import UserError
from toolkit.engines.trackers import TRACKER_CLASSES, NoTracker, FileTracker

TRACKERS = ("tensorboard", "trackio", "jsonl", "csv")
_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio"}  # tracker -> the package it needs


class TrackerError(UserError, ValueError):
    """A log_with Accelerate refuses with ValueError: one sentence here, still a ValueError for scripts that
    catch Accelerate's."""


def _is_tracker(item) -> bool:
    """A tracker object the user built (a GeneralTracker subclass, or anything with its methods)."""
    return not isinstance(item, str) and all(hasattr(item, a) for a in ("name", "log", "store_init_configuration"))


def _names(log_with, known) -> list:
    """log_with as a list of tracker names (LoggerType members by value, lower case) and tracker objects."""
    if log_with is None:
        return []
    items = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    resolved = []
    for item in items:
        if _is_tracker(item):
            resolved.append(item)
            continue
        name = item.value if isinstance(item, enum.Enum) else item
        if not isinstance(name, str) or name.lower() not in (*known, "all"):
            raise TrackerError(f"unknown tracker {item!r} in log_with; choose from {', '.join(known)} or all, "
                               f"or pass a tracker object (an accelerate GeneralTracker).")
        # "all", as in Accelerate: every tracker here whose package is installed (the others are given too)
        for name in [n for n in TRACKERS if _installed(n)] if name.lower() == "all" else [name.lower()]:
            if name not in resolved:
                resolved.append(name)
    return resolved


def resolve_log_with(log_with) -> list:
    """Accelerate's `log_with` forms (None, "all", a name, a LoggerType, a tracker object, a list of them) as a
    list of tracker names and objects, without repeats.

    >>> resolve_log_with(["jsonl", "csv", "jsonl"])
    ['jsonl', 'csv']
    >>> resolve_log_with(None)
    []
    >>> resolve_log_with("wandbb")
    Traceback (most recent call last):
    toolkit.engines.tracking.TrackerError: unknown tracker 'wandbb' in log_with; choose from tensorboard, \
trackio, jsonl, csv or all, or pass a tracker object (an accelerate GeneralTracker).
    """
    return _names(log_with, TRACKERS)


def _installed(name: str) -> bool:
    package = _PACKAGES.get(name)
    return package is None or importlib.util.find_spec(package) is not None


def check_trackers(log_with, logging_dir) -> list:
    """`resolve_log_with`, then refuse what `build_trackers` could not start: a tracker that writes files
    with no folder to write them in, or one whose package is missing. Cheap and without side effects, so
    every rank can call it when the engine is built, as Accelerate checks log_with in its constructor.

    >>> check_trackers("jsonl", None)
    Traceback (most recent call last):
    toolkit.engines.tracking.TrackerError: the jsonl tracker writes files: pass project_dir= (or a \
ProjectConfiguration with a logging_dir) to the Accelerator.
    """
    items = resolve_log_with(log_with)
    for name in (i for i in items if isinstance(i, str)):
        _refuse_unbuildable(name, TRACKER_CLASSES[name].requires_logging_directory, logging_dir)
    return items


def _refuse_unbuildable(name: str, requires_logging_directory: bool, logging_dir):
    if requires_logging_directory and logging_dir is None:
        raise TrackerError(f"the {name} tracker writes files: pass project_dir= (or a ProjectConfiguration with a "
                           f"logging_dir) to the Accelerator.")
    if not _installed(name):
        raise UserError(f"the {name} tracker needs the {_PACKAGES[name]} package: run `pip install {_PACKAGES[name]}`.")


def build_trackers(log_with, project_name: str, logging_dir, config: dict | None = None,
                   init_kwargs: dict | None = None) -> list:
    """Start the trackers of `log_with` for `project_name`, as Accelerate's `init_trackers` does: each is built
    with `init_kwargs[its name]`, started, then given `config` as hyperparameters. Tracker objects the user
    passed are used as they are (started and given the config too). Call it on the main process only.

    >>> import pathlib, tempfile
    >>> folder = tempfile.mkdtemp()
    >>> trackers = build_trackers("jsonl", "demo", folder, config={"lr": 0.1})
    >>> for tracker in trackers:
    ...     tracker.log({"loss": 0.5}, step=3)
    ...     tracker.finish()
    >>> print(pathlib.Path(folder, "demo", "log.jsonl").read_text(), end="")
    {"config": {"lr": 0.1}}
    {"step": 3, "loss": 0.5}
    """
    init_kwargs = init_kwargs or {}
    trackers = []
    for item in check_trackers(log_with, logging_dir):  # all checked before any folder is made
        if not isinstance(item, str):
            trackers.append(item)
            continue
        cls, kwargs = TRACKER_CLASSES[item], init_kwargs.get(item, {})
        trackers.append(cls(project_name, logging_dir, **kwargs) if cls.requires_logging_directory
                        else cls(project_name, **kwargs))
    for tracker in trackers:
        getattr(tracker, "start", lambda: None)()  # Accelerate starts user-built trackers too
    if config is not None:
        for tracker in trackers:
            tracker.store_init_configuration(config)
    return trackers


def find_tracker(trackers: list, name: str, unwrap: bool = False):
    """Accelerate's `get_tracker`: the tracker called `name` (its underlying writer with unwrap=True); a no-op
    tracker where none runs (the other processes, or before init_trackers), and an error where trackers run
    but none is called `name`.

    >>> find_tracker([], "jsonl").log({"loss": 1.0})  # does nothing, as on a process that does not log
    >>> find_tracker(build_trackers("csv", "demo", __import__("tempfile").mkdtemp()), "tensorboard")
    Traceback (most recent call last):
    toolkit.engines.tracking.TrackerError: no tracker called 'tensorboard' runs here (these run: csv); add it \
to log_with.
    """
    if not trackers:
        return NoTracker()
    for tracker in trackers:
        if tracker.name == name:
            return tracker.tracker if unwrap else tracker
    running = ", ".join(t.name for t in trackers)
    raise TrackerError(f"no tracker called {name!r} runs here (these run: {running}); add it to log_with.")


def for_accelerate(log_with, logging_dir=None):
    """What to give a real `Accelerator(log_with=...)` so every tracker here runs under it and writes where the
    other engines write. jsonl and csv are registered by name (`register_tracker_class`), so `init_trackers`
    builds them with the project name, logging_dir and init_kwargs, as its own; a tracker *object* would only
    be started and given the config. Accelerate's other names (wandb, ...) pass; refusals are `check_trackers`'.

    >>> for_accelerate(["jsonl", "tensorboard"], "runs")
    ['jsonl', 'tensorboard']
    >>> for_accelerate(None) is None
    True
    """
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, GeneralTracker

    classes = {**LOGGER_TYPE_TO_CLASS, **TRACKER_CLASSES}
    items = _names(log_with, TRACKERS + tuple(n for n in LOGGER_TYPE_TO_CLASS if n not in TRACKERS))
    strangers = [i.name for i in items if not isinstance(i, (str, GeneralTracker))]
    if strangers:
        raise TrackerError(f"the tracker object {strangers[0]!r} must subclass accelerate.tracking.GeneralTracker "
                           f"to run under a real Accelerator.")
    for name in (i for i in items if isinstance(i, str)):
        _refuse_unbuildable(name, classes[name].requires_logging_directory, logging_dir)
        if issubclass(classes[name], FileTracker):
            _register_with_accelerate(classes[name])
    return items or None  # an empty list would make Accelerate warn that no tracker is installed


def _register_with_accelerate(cls):
    """Register `cls`, made an accelerate GeneralTracker, under its name (once; a class the user registered
    under that name is left in place)."""
    from accelerate import tracking

    if cls.name in tracking.LOGGER_TYPE_TO_CLASS:
        return
    if not hasattr(tracking, "register_tracker_class"):
        raise UserError(f"the {cls.name} tracker under the accelerate engine needs an accelerate with "
                        f"register_tracker_class: run `pip install -U accelerate`.")
    adapter = type(cls.__name__, (cls, tracking.GeneralTracker), {"__module__": __name__, "__doc__": cls.__doc__})
    tracking.register_tracker_class(adapter)


class TrackingMixin:
    """Accelerate's tracker calls for the plain engines. Needs: `log_with` (checked by check_trackers on every
    rank), `logging_dir`, `is_main_process`; `trackers` is empty off the main process."""

    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None):
        """Start the trackers named by log_with, on the main process only, with `config` as hyperparameters."""
        if self.is_main_process:
            self.trackers = build_trackers(self.log_with, project_name, self.logging_dir, config, init_kwargs or {})

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        """Log `values` to every tracker (main process only)."""
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def get_tracker(self, name: str, unwrap: bool = False):
        """The tracker called `name` (its underlying writer with unwrap=True); a no-op one where none runs."""
        return find_tracker(self.trackers, name, unwrap)

    def _finish_trackers(self):
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
