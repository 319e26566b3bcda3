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

import csv
import enum
import importlib.util
import json
import os
import time

from toolkit.errors import UserError

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
        _refuse_unbuildable(name, _CLASSES[name].requires_logging_directory, logging_dir)
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
        cls, kwargs = _CLASSES[item], init_kwargs.get(item, {})
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


def tensors_to_numbers(value, other=lambda v: v):
    """`value` with every tensor (and numpy value) as a Python number or list, as Accelerate's `listify` makes
    them for TensorBoard; `other` maps any other object (the file trackers pass `str`; a trackio.Image stays).
    trackio drops a tensor without a word, so its tracker is given numbers too.

    >>> import torch
    >>> tensors_to_numbers({"loss": torch.tensor(0.5), "sizes": (torch.tensor([1, 2]),), "phase": "eval"})
    {'loss': 0.5, 'sizes': [[1, 2]], 'phase': 'eval'}
    """
    if isinstance(value, dict):
        return {str(k): tensors_to_numbers(v, other) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [tensors_to_numbers(v, other) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and numpy scalars (0-d: a plain number)
        return tensors_to_numbers(value.tolist(), other)
    return other(value)


def _plain(value):
    """`value` as JSON holds it: numbers, strings, lists, dicts; anything else as its text."""
    return tensors_to_numbers(value, str)


def _flatten(values: dict, leaf, prefix: str = "") -> dict:
    """`values` (made `_plain`) with nested dicts as `outer/inner` keys (TensorBoard's naming) and `leaf` applied
    to every other value."""
    flat = {}
    for key, value in _plain(values).items():
        if isinstance(value, dict):
            flat.update(_flatten(value, leaf, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = leaf(value)
    return flat


def flat_hparams(values: dict) -> dict:
    """`values` as TensorBoard's `add_hparams` takes them: nested dicts become `outer/inner` keys, numbers,
    strings and bools stay, anything else (a list, None) becomes its text, where add_hparams would refuse it.

    >>> flat_hparams({"lr": 0.1, "optim": {"name": "adam", "betas": (0.9, 0.99)}, "seed": None})
    {'lr': 0.1, 'optim/name': 'adam', 'optim/betas': '[0.9, 0.99]', 'seed': 'None'}
    """
    return _flatten(values, lambda v: v if isinstance(v, (bool, int, float, str)) else str(v))


def _refuse_kwargs(name: str, kwargs: dict, what: str):
    if kwargs:
        raise UserError(f"the {name} tracker takes no {what} (got {', '.join(kwargs)}); remove them.")


class NoTracker:
    """What `get_tracker` gives where no tracker runs: every call does nothing (Accelerate's blank tracker)."""

    name, requires_logging_directory, tracker = "none", False, None

    def start(self, *args, **kwargs):  # the same no-op stands for start, store_init_configuration, log, finish
        pass

    store_init_configuration = log = finish = start


class TensorBoardTracker:
    """Accelerate's TensorBoardTracker without accelerate: a `SummaryWriter` in `logging_dir/run_name`; numbers
    go to add_scalar, strings to add_text, dicts of numbers to add_scalars (other values are skipped, as there).
    The config goes, flattened (`flat_hparams`), to add_hparams, whose event file lands in a `<time.time()>`
    subfolder beside `hparams.yml` (Accelerate writes the two in two subfolders stamped a moment apart)."""

    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir, **kwargs):
        self.run_name, self.logging_dir = run_name, os.path.join(logging_dir, run_name)
        self.init_kwargs, self.writer = kwargs, None

    def start(self):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    tracker = property(lambda self: self.writer)

    def store_init_configuration(self, values: dict):
        import yaml

        run = str(time.time())
        self.writer.add_hparams(flat_hparams(values), metric_dict={}, run_name=run)
        self.writer.flush()
        with open(os.path.join(self.logging_dir, run, "hparams.yml"), "w") as file:
            yaml.safe_dump(_plain(values), file)

    def log(self, values: dict, step: int | None = None, **kwargs):
        for key, value in tensors_to_numbers(values).items():
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self):
        self.writer.close()


class TrackioTracker:
    """Accelerate's TrackioTracker: `trackio.init(project=run_name, **kwargs)`, then the run's `log` and
    `finish`. Trackio keeps a local SQLite file per project in $TRACKIO_DIR (default ~/.cache/huggingface/trackio)
    unless `space_id`/`server_url` (or TRACKIO_SPACE_ID/TRACKIO_SERVER_URL) send it elsewhere."""

    name = "trackio"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        self.run_name, self.init_kwargs, self.run = run_name, kwargs, None

    def start(self):
        import trackio

        self.run = trackio.init(project=self.run_name, **self.init_kwargs)

    tracker = property(lambda self: self.run)

    def store_init_configuration(self, values: dict):
        # The run's config dict, saved with its first log; Accelerate's `trackio.config.update(values,
        # allow_val_change=True)` is that dict's update, so it also stores a key "allow_val_change".
        self.run.config.update(_plain(values))

    def log(self, values: dict, step: int | None = None, **kwargs):
        self.run.log(tensors_to_numbers(values), step=step, **kwargs)

    def finish(self):
        self.run.finish()


class _FileTracker:
    """A tracker writing `logging_dir/run_name/<filename>`, opened for appending when it starts."""

    requires_logging_directory = True
    filename = ""

    def __init__(self, run_name: str, logging_dir, **kwargs):
        _refuse_kwargs(self.name, kwargs, "init_kwargs")
        self.path = os.path.join(logging_dir, run_name, self.filename)
        self.file = None

    tracker = property(lambda self: self.file)

    def start(self):
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.file = open(self.path, "a", newline="", encoding="utf-8")

    def finish(self):
        self.file.close()


class JSONLTracker(_FileTracker):
    """One JSON object per line in `logging_dir/run_name/log.jsonl`: `{"config": ...}` when a config is given,
    then `{"step": step, **values}` per log call (tensors as numbers). Each line is flushed as it is written,
    so a killed run keeps every line it logged; a run that starts again appends to the same file.

    >>> import pathlib, tempfile
    >>> tracker = JSONLTracker("demo", tempfile.mkdtemp())
    >>> tracker.start(); tracker.log({"loss": 0.25, "lr": {"group0": 0.1}}); tracker.finish()
    >>> print(pathlib.Path(tracker.path).read_text(), end="")
    {"step": null, "loss": 0.25, "lr": {"group0": 0.1}}
    """

    name, filename = "jsonl", "log.jsonl"

    def store_init_configuration(self, values: dict):
        self._write({"config": _plain(values)})

    def log(self, values: dict, step: int | None = None, **kwargs):
        _refuse_kwargs(self.name, kwargs, "log_kwargs")
        self._write({"step": step, **_plain(values)})

    def _write(self, record: dict):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


class CSVTracker(_FileTracker):
    """A table in `logging_dir/run_name/log.csv`: a `step` column, then one column per logged key in the order
    keys first appear (a dict of numbers gives `key/inner` columns, other non-numbers their JSON text). A log
    call that brings a new key rewrites the file once with the wider header, earlier rows empty there; every
    other call appends one flushed row. The config goes to `config.json` beside it: a table has no place for it.

    >>> import pathlib, tempfile
    >>> tracker = CSVTracker("demo", tempfile.mkdtemp()); tracker.start()
    >>> tracker.log({"loss": 0.5}, step=1); tracker.log({"loss": 0.25, "acc": 0.75}, step=2); tracker.finish()
    >>> print(pathlib.Path(tracker.path).read_text(), end="")
    step,loss,acc
    1,0.5,
    2,0.25,0.75
    """

    name, filename, columns = "csv", "log.csv", ()

    def start(self):
        if os.path.exists(self.path):  # a run that starts again continues the table it left
            with open(self.path, newline="", encoding="utf-8") as file:
                self.columns = next(csv.reader(file), [])
        super().start()

    def store_init_configuration(self, values: dict):
        with open(os.path.join(os.path.dirname(self.path), "config.json"), "w", encoding="utf-8") as file:
            json.dump(_plain(values), file, indent=2)

    def log(self, values: dict, step: int | None = None, **kwargs):
        _refuse_kwargs(self.name, kwargs, "log_kwargs")
        row = {"step": step, **_flatten(values, lambda v: v if v is None or isinstance(v, (int, float, str))
                                        else json.dumps(v))}
        new = [key for key in row if key not in self.columns]
        if new:
            self._widen([*self.columns, *new])
        csv.DictWriter(self.file, self.columns).writerow(row)
        self.file.flush()

    def _widen(self, columns: list):
        """Rewrite the file under a header with `columns` (through a temporary file: a crash keeps the old one)."""
        self.file.close()
        rows = []
        if self.columns:
            with open(self.path, newline="", encoding="utf-8") as file:
                rows = list(csv.DictReader(file))
        temporary = self.path + ".tmp"
        with open(temporary, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(temporary, self.path)
        self.columns = columns
        super().start()


_CLASSES = {"tensorboard": TensorBoardTracker, "trackio": TrackioTracker, "jsonl": JSONLTracker, "csv": CSVTracker}


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

    classes = {**LOGGER_TYPE_TO_CLASS, **_CLASSES}
    items = _names(log_with, TRACKERS + tuple(n for n in LOGGER_TYPE_TO_CLASS if n not in TRACKERS))
    strangers = [i.name for i in items if not isinstance(i, (str, GeneralTracker))]
    if strangers:
        raise TrackerError(f"the tracker object {strangers[0]!r} must subclass accelerate.tracking.GeneralTracker "
                           f"to run under a real Accelerator.")
    for name in (i for i in items if isinstance(i, str)):
        _refuse_unbuildable(name, classes[name].requires_logging_directory, logging_dir)
        if issubclass(classes[name], _FileTracker):
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
