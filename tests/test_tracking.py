"""Experiment trackers (toolkit/engines/tracking.py): what each one writes, read back from its files with the
reader its users would use, and the same jsonl/csv files under a real Accelerator as under the other engines."""

import csv
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toolkit.engines import tracking
from toolkit.engines.tracking import build_trackers, find_tracker, for_accelerate, resolve_log_with
from toolkit.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"lr": 0.1, "optim": {"name": "adamw", "betas": [0.9, 0.99]}, "epochs": 2, "amp": True, "note": None}


def one_sentence(error) -> bool:
    text = str(error)
    return "\n" not in text and text.endswith(".") and text.count(". ") == 0


# -- TensorBoard --------------------------------------------------------------------------------------
def hparams_of(folder: Path) -> dict:
    """The hyperparameters in the add_hparams event file under `folder`, read as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    content = accumulator.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    values = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {key: getattr(value, value.WhichOneof("kind")) for key, value in values.items()}


def test_tensorboard_holds_scalars_at_their_steps_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tracker,) = build_trackers("tensorboard", "proj", tmp_path, config=CONFIG)
    tracker.log({"loss": torch.tensor(0.5), "accuracy": 0.25}, step=3)
    tracker.log({"loss": 0.125, "phase": "eval", "lrs": {"head": 0.01}}, step=7)
    tracker.finish()

    accumulator = EventAccumulator(str(tmp_path / "proj"))  # Accelerate's folder: logging_dir/project_name
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("loss")] == [(3, 0.5), (7, 0.125)]
    assert [(s.step, s.value) for s in accumulator.Scalars("accuracy")] == [(3, 0.25)]
    assert "phase/text_summary" in accumulator.Tags()["tensors"]
    (run,) = [p for p in (tmp_path / "proj").iterdir() if p.is_dir() and (p / "hparams.yml").exists()]
    assert hparams_of(run) == {"lr": 0.1, "optim/name": "adamw", "optim/betas": "[0.9, 0.99]", "epochs": 2.0,
                               "amp": True, "note": "None"}
    import yaml

    assert yaml.safe_load((run / "hparams.yml").read_text()) == CONFIG


# -- JSONL and CSV ------------------------------------------------------------------------------------
def test_jsonl_holds_exactly_what_was_logged(tmp_path):
    (tracker,) = build_trackers("jsonl", "proj", tmp_path, config=CONFIG)
    tracker.log({"loss": torch.tensor(0.5), "lr": {"group0": 0.1}}, step=3)
    tracker.log({"accuracy": 0.75, "phase": "eval"}, step=4)
    tracker.finish()

    lines = (tmp_path / "proj" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"config": CONFIG},
        {"step": 3, "loss": 0.5, "lr": {"group0": 0.1}},
        {"step": 4, "accuracy": 0.75, "phase": "eval"},
    ]


def test_csv_holds_exactly_what_was_logged_with_late_columns(tmp_path):
    (tracker,) = build_trackers("csv", "proj", tmp_path, config=CONFIG)
    tracker.log({"loss": 0.5}, step=1)
    tracker.log({"loss": 0.25, "lr": {"group0": 0.1}}, step=2)  # new keys: the header widens
    tracker.finish()
    (again,) = build_trackers("csv", "proj", tmp_path)  # a run started again continues the table
    again.log({"loss": 0.125}, step=3)
    again.finish()

    with open(tmp_path / "proj" / "log.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    assert rows == [{"step": "1", "loss": "0.5", "lr/group0": ""},
                    {"step": "2", "loss": "0.25", "lr/group0": "0.1"},
                    {"step": "3", "loss": "0.125", "lr/group0": ""}]
    assert json.loads((tmp_path / "proj" / "config.json").read_text()) == CONFIG


KILLED = """
import os, sys
from toolkit.engines.tracking import build_trackers
trackers = build_trackers(["jsonl", "csv"], "proj", sys.argv[1], config={"lr": 0.1})  # kept: open files
for tracker in trackers:
    tracker.log({"loss": 0.5}, step=1)
    tracker.log({"loss": 0.25}, step=2)
os.kill(os.getpid(), 9)
"""


def test_a_killed_run_keeps_every_line_it_logged(tmp_path):
    proc = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    lines = (tmp_path / "proj" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"config": {"lr": 0.1}}, {"step": 1, "loss": 0.5},
                                                    {"step": 2, "loss": 0.25}]
    assert (tmp_path / "proj" / "log.csv").read_text().splitlines() == ["step,loss", "1,0.5", "2,0.25"]


# -- trackio --------------------------------------------------------------------------------------------
@pytest.fixture
def local_trackio(tmp_path, monkeypatch):
    """trackio writing under tmp_path, with every attempt to reach another host refused and recorded."""
    home = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(home))  # read when trackio is imported
    for name in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SYSTEM"):
        monkeypatch.delenv(name, raising=False)
    import huggingface_hub.constants

    # trackio.init asks huggingface.co who the user is whenever a token is saved on the machine.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    import trackio  # noqa: F401 (its modules bind TRACKIO_DIR at import: an earlier import is redirected)

    for module in [m for n, m in list(sys.modules.items()) if n.startswith("trackio") and m is not None]:
        if hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", home)
    attempts = []
    real_lookup, real_connect = socket.getaddrinfo, socket.socket.connect

    def lookup(host, *args, **kwargs):
        if host not in ("localhost", "127.0.0.1", "::1"):
            attempts.append(host)
            raise OSError(f"test: no network ({host})")
        return real_lookup(host, *args, **kwargs)

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in ("127.0.0.1", "::1"):
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return home, attempts


def test_trackio_logs_locally_and_reads_back(local_trackio):
    from trackio.sqlite_storage import SQLiteStorage

    home, attempts = local_trackio
    (tracker,) = build_trackers("trackio", "proj", None, config=CONFIG,
                                init_kwargs={"trackio": {"name": "run-1", "auto_log_cpu": False}})
    tracker.log({"loss": torch.tensor(0.5)}, step=3)
    tracker.log({"loss": 0.25, "accuracy": 0.75}, step=5)
    tracker.finish()

    assert (home / "proj.db").exists()
    assert SQLiteStorage.get_runs("proj") == ["run-1"]
    logs = [{k: v for k, v in row.items() if k != "timestamp"} for row in SQLiteStorage.get_logs("proj", "run-1")]
    assert logs == [{"loss": 0.5, "step": 3}, {"loss": 0.25, "accuracy": 0.75, "step": 5}]
    config = SQLiteStorage.get_run_config("proj", "run-1")
    assert {k: v for k, v in config.items() if not k.startswith("_")} == CONFIG
    assert attempts == []


# -- choosing trackers ----------------------------------------------------------------------------------
def test_an_unknown_tracker_is_refused_in_one_sentence_naming_the_choices():
    with pytest.raises(UserError) as caught:
        resolve_log_with(["jsonl", "tensorbaord"])
    assert one_sentence(caught.value) and "'tensorbaord'" in str(caught.value)
    assert all(name in str(caught.value) for name in tracking.TRACKERS)
    assert isinstance(caught.value, ValueError)  # what Accelerate raises, for scripts that catch it


def test_log_with_takes_accelerates_forms():
    from accelerate.tracking import GeneralTracker
    from accelerate.utils import LoggerType

    mine = GeneralTracker(_blank=True)
    mine.name = "mine"
    assert resolve_log_with(LoggerType.TENSORBOARD) == ["tensorboard"]
    assert resolve_log_with([LoggerType.TRACKIO, "JSONL", "jsonl", mine]) == ["trackio", "jsonl", mine]
    assert resolve_log_with(["all", mine]) == [*tracking.TRACKERS, mine]  # all installed here
    assert resolve_log_with(LoggerType.ALL) == list(tracking.TRACKERS)


def test_missing_folder_and_missing_package_are_one_sentence(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="pass project_dir=") as caught:
        build_trackers(["csv"], "proj", None)
    assert one_sentence(caught.value)
    monkeypatch.setitem(sys.modules, "trackio", None)  # as if trackio were not installed
    with pytest.raises(UserError, match="pip install trackio") as caught:
        build_trackers(["jsonl", "trackio"], "proj", tmp_path)
    assert one_sentence(caught.value)
    assert not (tmp_path / "proj").exists()  # refused before any tracker made its folder
    assert resolve_log_with("all") == ["tensorboard", "jsonl", "csv"]  # all: the installed ones


class Recorder:
    """A user's own tracker object (no accelerate needed): used as it is."""

    name, requires_logging_directory = "recorder", False

    def __init__(self):
        self.calls = []

    tracker = property(lambda self: self.calls)

    def start(self):
        self.calls.append("start")

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None, **kwargs):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append("finish")


def test_a_tracker_object_is_used_as_is_and_found_by_name(tmp_path):
    recorder = Recorder()
    trackers = build_trackers([recorder, "jsonl"], "proj", tmp_path, config={"lr": 0.1})
    assert trackers[0] is recorder and recorder.calls == ["start", ("config", {"lr": 0.1})]
    assert find_tracker(trackers, "recorder") is recorder
    assert find_tracker(trackers, "jsonl", unwrap=True) is trackers[1].file
    with pytest.raises(UserError, match="no tracker called 'wandb'") as caught:
        find_tracker(trackers, "wandb")
    assert one_sentence(caught.value)
    assert find_tracker([], "jsonl").tracker is None  # the other processes: a tracker that does nothing
    for tracker in trackers:
        tracker.finish()


# -- under a real Accelerator -----------------------------------------------------------------------------
@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def test_a_real_accelerator_writes_the_same_files(tmp_path, fresh_accelerate_state):
    from accelerate import Accelerator

    values, config = {"loss": torch.tensor(0.5), "lr": {"group0": 0.1}}, {"lr": 0.1, "optim": {"name": "adamw"}}
    ours = build_trackers(["jsonl", "csv"], "proj", tmp_path / "torch", config)
    for tracker in ours:
        tracker.log(values, step=3)
        tracker.finish()

    project_dir = tmp_path / "accelerate"
    accelerator = Accelerator(cpu=True, log_with=for_accelerate(["jsonl", "csv"], project_dir), project_dir=project_dir)
    accelerator.init_trackers("proj", config)
    accelerator.log(values, step=3)
    assert accelerator.get_tracker("jsonl").name == "jsonl"
    accelerator.end_training()

    for name in ("log.jsonl", "log.csv", "config.json"):
        assert (project_dir / "proj" / name).read_text() == (tmp_path / "torch" / "proj" / name).read_text(), name
    assert json.loads((project_dir / "proj" / "log.jsonl").read_text().splitlines()[1]) == {
        "step": 3, "loss": 0.5, "lr": {"group0": 0.1}}


def test_for_accelerate_refuses_as_the_other_engines_do():
    with pytest.raises(UserError, match="pass project_dir=") as caught:
        for_accelerate("jsonl", None)
    assert one_sentence(caught.value)
    with pytest.raises(UserError, match="unknown tracker 'jsnl'"):
        for_accelerate(["jsnl"], "runs")
    with pytest.raises(UserError, match="must subclass accelerate.tracking.GeneralTracker"):
        for_accelerate([Recorder()], "runs")  # Accelerate would refuse it with a long ValueError
    assert for_accelerate(["wandb", "all"], "runs") == ["wandb", *tracking.TRACKERS]  # Accelerate's own pass on


def test_the_module_does_not_import_accelerate():
    code = "import sys, toolkit.engines.tracking; print(sorted(m for m in sys.modules if m.startswith('accelerate')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr
