"""The four experiment trackers (TensorBoard, Trackio, JSONL, CSV) in the shape of Accelerate's `GeneralTracker`
(`name`, `requires_logging_directory`, `tracker`, `start`, `store_init_configuration`, `log`, `finish`) and its
constructor convention, so that toolkit/engines/tracking.py builds them for every engine and a real Accelerator
can run the file ones too. Each writes under `<logging_dir>/<project_name>/`.
"""

from __future__ import annotations

import csv
import json
import os
import time

from toolkit.errors import UserError

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


class FileTracker:
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


class JSONLTracker(FileTracker):
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


class CSVTracker(FileTracker):
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


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "trackio": TrackioTracker, "jsonl": JSONLTracker, "csv": CSVTracker}
