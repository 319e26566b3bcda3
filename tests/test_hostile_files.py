"""Files the toolkit reads, made hostile or unusual: refused in one sentence without running anything, or
decoded as they should be (parquet images written without Hugging Face metadata)."""

import io
import os
import pathlib
import pickle
import re

import numpy as np
import pytest

from conftest import CONFIGS
from hostile import CreatesFileOnLoad
from toolkit.data import load_data
from toolkit.data.memory import load_cifar
from toolkit.errors import UserError
from toolkit.data.safe_pickle import load_restricted


def cifar_folder(root, first_batch):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = first_batch if name == "data_batch_1" else {b"data": np.zeros((4, 3072), np.uint8),
                                                             b"labels": [0, 1, 2, 3]}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    return folder


def test_a_pickle_that_runs_code_is_refused_and_nothing_runs(tmp_path):
    target = tmp_path / "created-by-the-pickle"
    folder = cifar_folder(tmp_path / "data", {b"data": CreatesFileOnLoad(target), b"labels": [0]})
    with pytest.raises(UserError) as raised:
        load_cifar("cifar10", tmp_path / "data", download=False)
    message = str(raised.value)
    assert str(folder / "data_batch_1") in message and "io.open" in message and "\n" not in message, message
    assert not target.exists()
    pickle.loads(pickle.dumps(CreatesFileOnLoad(target)))  # the same bytes through plain pickle do create it
    assert target.exists()


def test_the_restricted_unpickler_reads_what_cifar_files_hold(tmp_path):
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": [6, 9], b"filenames": [b"a.png", b"b.png"],
             b"data": np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072), "text": "str", "n": 3}
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        loaded = load_restricted(io.BytesIO(pickle.dumps(batch, protocol=protocol)), "batch")
        assert np.array_equal(loaded[b"data"], batch[b"data"]) and loaded[b"labels"] == [6, 9]
        assert loaded[b"filenames"] == [b"a.png", b"b.png"] and loaded["text"] == "str" and loaded["n"] == 3
    for refused in (os.system, eval, np.load):
        payload = pickle.dumps(refused)
        with pytest.raises(UserError, match=f"asks to run .*{refused.__name__}"):
            load_restricted(io.BytesIO(payload), "evil")


def naming(module, name) -> bytes:
    """A pickle (protocol 2) whose whole content is one global, module.name, written opcode by opcode."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."


# Each module and each name is on the dataset unpickler's list, but not together; or the module is one beside a
# listed one. A check of the module and the name apart, or of a module prefix, lets them through.
DATASET_NEAR_MISSES = [("numpy", "_reconstruct"), ("numpy.core.multiarray", "ndarray"), ("_codecs", "dtype"),
                       ("numpy", "encode"), ("numpy._core.multiarray", "_frombuffer"), ("numpy.core", "scalar"),
                       ("numpy.core.multiarray.x", "_reconstruct")]


@pytest.mark.parametrize("module, name", DATASET_NEAR_MISSES)
def test_the_dataset_unpickler_refuses_a_near_miss_of_its_list(module, name):
    assert load_restricted(io.BytesIO(naming("numpy", "ndarray")), "listed") is np.ndarray  # the exact pair loads
    with pytest.raises(UserError, match=rf"^near asks to run {re.escape(module)}\.{name}, which a dataset file"):
        load_restricted(io.BytesIO(naming(module, name)), "near")


# The checkpoint index unpickler takes DCP's metadata module whole, torch's dtypes and a few named classes.
INDEX_NEAR_MISSES = [("torch", "load"), ("torch", "Tensor"), ("torch.distributed.checkpoint", "metadata"),
                     ("torch.distributed.checkpoint.metadata_x", "Metadata"), ("torch.serialization", "load"),
                     ("torch.distributed.checkpoint.filesystem", "FileSystemReader"), ("pathlib", "Path")]


@pytest.mark.parametrize("module, name", INDEX_NEAR_MISSES)
def test_the_checkpoint_index_unpickler_refuses_a_near_miss_of_its_list(tmp_path, module, name):
    import torch

    from toolkit.checkpoint.sharded import INDEX, read_index

    for listed, expected in ((("torch", "float32"), torch.float32), (("pathlib", "PosixPath"), pathlib.PosixPath)):
        (tmp_path / INDEX).write_bytes(naming(*listed))
        assert read_index(tmp_path) is expected  # an exact entry loads
    (tmp_path / INDEX).write_bytes(naming(module, name))
    with pytest.raises(UserError, match=rf"it asks to run {re.escape(module)}\.{name}, which a checkpoint index"):
        read_index(tmp_path)


def test_a_failed_download_removes_what_it_created(tmp_path, monkeypatch):
    import torchvision.datasets.utils as tv_utils

    def fail_half_way(url, download_root, md5=None):  # offline here: the archive starts, then breaks
        (tmp_path / "new" / "data" / "cifar-10-python.tar.gz").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "new" / "data" / "cifar-10-python.tar.gz").write_bytes(b"partial")
        (tmp_path / "new" / "data" / "cifar-10-batches-py").mkdir()
        raise OSError("connection reset")

    monkeypatch.setattr(tv_utils, "download_and_extract_archive", fail_half_way)
    with pytest.raises(UserError, match="downloading it failed"):
        load_cifar("cifar10", tmp_path / "new" / "data")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()  # a folder the user made stays, with what it held
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    monkeypatch.setattr(tv_utils, "download_and_extract_archive", lambda *a, **k: (_ for _ in ()).throw(OSError()))
    with pytest.raises(UserError):
        load_cifar("cifar10", tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def encoded(image, fmt="PNG"):
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def write_parquet(folder, images_by_split, as_struct):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for split, images in images_by_split.items():
        column = [{"bytes": encoded(im), "path": None} for im in images] if as_struct else [encoded(im) for im in images]
        pq.write_table(pa.table({"img": column, "label": list(range(len(images)))}), str(folder / f"{split}.parquet"))


@pytest.mark.parametrize("as_struct", [True, False], ids=["bytes-path-structs", "raw-binary"])
def test_parquet_images_without_metadata_are_decoded_in_any_mode(tmp_path, as_struct):
    from PIL import Image

    rng = np.random.default_rng(0)
    rgb = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(4)]
    images = [rgb[0], rgb[1].convert("L"), rgb[2].convert("RGBA"), rgb[3].convert("P")]
    write_parquet(tmp_path / "pq", {"train": images, "test": images[:2]}, as_struct)
    data = load_data(f"hf:{tmp_path / 'pq'}", tmp_path, seed=0)
    assert data.train_x.shape == (4, 3, 32, 32) and data.test_x.shape == (2, 3, 32, 32)
    for got, image in zip(data.train_x, images):  # PNG is lossless: PIL's own RGB conversion, pixel for pixel
        assert np.array_equal(got.numpy(), np.asarray(image.convert("RGB")).transpose(2, 0, 1)), image.mode


def test_parquet_images_of_a_size_the_recipe_cannot_take_are_named(tmp_path):
    from PIL import Image

    small = Image.new("RGB", (20, 24))
    write_parquet(tmp_path / "pq", {"train": [small], "test": [small]}, as_struct=True)
    with pytest.raises(UserError, match="has a 20x24 image; the CIFAR models take 32x32"):
        load_data(f"hf:{tmp_path / 'pq'}", tmp_path, seed=0)
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_parquet(tmp_path / "bad", {"train": [small], "test": [small]}, as_struct=False)
    pq.write_table(pa.table({"img": [b"not an image"], "label": [0]}), str(tmp_path / "bad" / "train.parquet"))
    with pytest.raises(UserError, match="PIL cannot decode"):
        load_data(f"hf:{tmp_path / 'bad'}", tmp_path, seed=0)
    write_parquet(tmp_path / "mixed", {"train": [small], "test": [small]}, as_struct=True)
    pq.write_table(pa.table({"img": [b"x"], "label": [0]}), str(tmp_path / "mixed" / "test.parquet"))
    (tmp_path / "mixed" / "zz-test-2.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(UserError, match="could not be read as a parquet dataset") as raised:
        load_data(f"hf:{tmp_path / 'mixed'}", tmp_path, seed=0)
    assert "\n" not in str(raised.value)


def test_env_warns_for_every_gpu_profile_without_a_gpu():
    from toolkit.launch.launcher import check_devices
    from toolkit.launch.profiles import load_profile

    for name in ("single_gpu", "multi_gpu", "multi_node"):
        notes = check_devices(load_profile(str(CONFIGS / f"{name}.yaml")), gpus=0)
        assert len(notes) == 1 and notes[0].startswith("no GPU visible"), (name, notes)
    assert check_devices(load_profile(str(CONFIGS / "cpu.yaml")), gpus=0) == []


def test_output_folder_holding_a_run_is_refused_unless_resumed_or_restarted(tmp_path, monkeypatch):
    from toolkit.train.records import check_fresh_output_dir

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TOOLKIT_PARITY_DIR", raising=False)
    check_fresh_output_dir(tmp_path / "new", None)
    (tmp_path / "empty").mkdir()
    check_fresh_output_dir(tmp_path / "empty", None)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "epochs.csv").write_text("step\n1\n")
    with pytest.raises(UserError, match="already holds files of another run; continue that run with --resume auto, "
                                        "or pass a fresh folder"):
        check_fresh_output_dir(tmp_path / "used", None)
    check_fresh_output_dir(tmp_path / "used", "auto")
    check_fresh_output_dir(tmp_path / "used", None, restarts=1)  # torchrun restarted us: the recipe resumes there


def test_images_per_second_leave_out_the_warm_up():
    from toolkit.train.records import Throughput

    meter = Throughput(warmup_steps=2)
    for seconds in (3.0, 1.0, 0.25, 0.25, 0.5):  # a 4-second stall, then 3 steps of 100 images in 1 s
        meter.step(100, seconds)
    assert meter.images_per_s == 300.0 and meter.warmup_s == 4.0
    short = Throughput(warmup_steps=5)
    short.step(100, 2.0)
    assert short.images_per_s == 50.0  # a run no longer than its warm-up: over every step


def test_help_shows_every_default():
    import importlib.util

    from conftest import ROOT
    from toolkit.config import build_parser

    spec = importlib.util.spec_from_file_location("cifar_recipe_help", ROOT / "recipes" / "cifar.py")
    cifar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cifar)
    text = " ".join(build_parser(cifar.Config).format_help().split())
    for flag, default in (("--model", "resnet18"), ("--loader", "memory"), ("--engine", "auto"),
                          ("--epochs", "the model's preset"),
                          ("--output-dir", "runs/cifar")):
        assert f"(default: {default})" in text.split(f"{flag} ", 2)[-1].split(" --", 1)[0], (flag, text)


@pytest.mark.alone  # a time bound: refused at the first try (0.3 s and 2.4 s, idle), not after the 60 s timeout
@pytest.mark.parametrize("speaks_first", [True, False], ids=["greets-on-connect", "answers-garbage"])
def test_a_port_held_by_another_service_is_named_as_such(speaks_first, capfd):
    import time

    from toolkit.launch import rendezvous

    server, port = foreign_service(speaks_first)
    started = time.monotonic()
    with server, pytest.raises(UserError) as raised:
        rendezvous._connect("127.0.0.1", port, timeout=60)
    elapsed = time.monotonic() - started
    message = str(raised.value)
    assert "another service" in message and "main_process_port" in message and "\n" not in message, message
    # Nothing else on either stream (torch's client logs each retry with a C++ stack trace on fd 2), and
    # refused at the first try, not after the 60 s timeout: measured 0.3 s (greets) and 2.4 s (answers).
    assert capfd.readouterr() == ("", ""), capfd.readouterr()
    assert elapsed < 30, elapsed


def foreign_service(speaks_first):
    """(listening socket, port) of a plain TCP service on 127.0.0.1: it greets (like SSH) or answers any
    request with garbage (like HTTP)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve():  # a plain TCP service: greets (like SSH) or answers any request with garbage (like HTTP)
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if not speaks_first:
                    conn.recv(64)
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def hostile_checkpoint(tmp_path, edit):
    """A real checkpoint whose manifest stays consistent after `edit` changed a file (a crafted one)."""
    import hashlib
    import json

    from toolkit.checkpoint.functional import save_checkpoint
    from toolkit.models.nets import build_model

    state = {"step": 1, "epoch": 0, "samples_in_epoch": 0, "world_size": 1, "config": {"model": "tiny"}}
    import torch

    model = build_model("tiny", 10)
    path = save_checkpoint(tmp_path / "ckpt", 1, model=model, state=state,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    edit(path)
    files = {f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
             for f in path.iterdir() if f.name != "manifest.json"}
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {**{k: v for k, v in manifest["files"].items() if k in files}, **files}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


PROFILE = "distributed_type: MULTI_GPU\nnum_processes: 2\nmixed_precision: 'no'\n"


def run_folder(tmp_path, summary):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(summary)
    return tmp_path / "run"


def read_run_table(path):
    """What `toolkit compare RUN` reads and prints."""
    from toolkit.check.compare import read_run, table

    return table([read_run(path)])


def written(path, text):
    path.write_text(text)
    return path


def _pickled_optimizer(target):
    def edit(path):
        with open(path / "optimizer.bin", "wb") as f:
            pickle.dump({"state": CreatesFileOnLoad(target)}, f)
    return edit


HOSTILE = {  # name -> (make the file given tmp_path, how it is read given the file, words of the sentence)
    "profile with a python tag that runs code": (
        lambda t: written(t / "p.yaml", f"distributed_type: !!python/object/apply:os.system ['touch {t}/ran']\n"),
        lambda p: __import__("toolkit.launch.profiles").launch.profiles.load_profile(str(p)), "YAML"),
    "profile that is a list": (lambda t: written(t / "p.yaml", "- 1\n- 2\n"),
                               lambda p: __import__("toolkit.launch.profiles").launch.profiles.load_profile(str(p)), "p.yaml"),
    # Values of the wrong type that accelerate's parser lets through: a crash, or (use_cpu 'false', a true
    # string) a silently different run.
    "profile with use_cpu as text": (lambda t: written(t / "p.yaml", PROFILE + "use_cpu: 'false'\n"),
                                     lambda p: __import__("toolkit.launch.profiles").launch.profiles.load_profile(str(p)),
                                     "use_cpu must be true or false, not 'false'"),
    "profile with num_processes as a word": (lambda t: written(t / "p.yaml", "distributed_type: MULTI_GPU\n"
                                                               "num_processes: two\n"),
                                             lambda p: __import__("toolkit.launch.profiles").launch.profiles.load_profile(str(p)),
                                             "num_processes must be a whole number, not 'two'"),
    "profile with a fractional port": (lambda t: written(t / "p.yaml", PROFILE + "main_process_port: 1.5\n"),
                                       lambda p: __import__("toolkit.launch.profiles").launch.profiles.load_profile(str(p)),
                                       "main_process_port must be a whole number, not 1.5"),
    "summary.json that is a list": (lambda t: run_folder(t, "[1]"), read_run_table, "holds a list, not the object"),
    "summary.json with a text accuracy": (lambda t: run_folder(t, '{"global_batch_size": 4, "test_accuracy": "x"}'),
                                          read_run_table, "holds 'test_accuracy' = 'x', not a number"),
    "summary.json that is a folder": (lambda t: (run_folder(t, "{}") / "summary.json").unlink() or
                                      (t / "run" / "summary.json").mkdir() or t / "run", read_run_table,
                                      "is not a run this toolkit wrote"),
    "manifest naming a file outside the checkpoint": (
        lambda t: hostile_checkpoint(t, lambda p: None), "manifest-outside", "not a file of the checkpoint"),
    "state.json that is not JSON": (
        lambda t: hostile_checkpoint(t, lambda p: (p / "state.json").write_text("{not json")), "load",
        "state.json is unreadable"),
    "state.json that is a list": (
        lambda t: hostile_checkpoint(t, lambda p: (p / "state.json").write_text("[1, 2]")), "load", "not an object"),
    "optimizer.bin pickling a call": (
        lambda t: hostile_checkpoint(t, _pickled_optimizer(t / "ran")), "load", "Refusing to load"),
    # A resume reads state.json's keys: a file without them (hand-edited, another tool's) is named with the key.
    "state.json without step": (lambda t: hostile_checkpoint(t, _state_edit(lambda s: s.pop("step"))), "resume",
                                "state.json has no 'step', which a resume needs"),
    "state.json without config": (lambda t: hostile_checkpoint(t, _state_edit(lambda s: s.pop("config"))), "resume",
                                  "state.json has no 'config', which a resume needs"),
    "state.json with a text epoch": (lambda t: hostile_checkpoint(t, _state_edit(lambda s: s.update(epoch="1"))),
                                     "resume", "state.json holds 'epoch' = '1', not a whole number"),
    "state.json naming no model": (lambda t: hostile_checkpoint(t, _state_edit(lambda s: s.update(config={}))),
                                   "resume", "state.json names no model in 'config'"),
    "state.json that is not JSON, resumed": (
        lambda t: hostile_checkpoint(t, lambda p: (p / "state.json").write_text("{not json")), "resume",
        "state.json is unreadable"),
    "random_states_0.pkl without RNG states": (lambda t: hostile_checkpoint(t, _rng_edit({"random_state": 1})),
                                               "load", "its RNG file does not hold RNG states"),
}


def _state_edit(change):
    def edit(path):
        import json

        state = json.loads((path / "state.json").read_text())
        change(state)
        (path / "state.json").write_text(json.dumps(state))
    return edit


def _rng_edit(saved):
    def edit(path):
        import torch

        torch.save(saved, path / "random_states_0.pkl")
    return edit


def resume_the_recipe(path, out):
    """The CIFAR recipe resuming from `path` in this process, as `--resume PATH` does."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("cifar_recipe", ROOT / "recipes" / "cifar.py")
    cifar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cifar)
    cifar.main(["--dataset", "synthetic", "--model", "tiny", "--max-steps", "1", "--output-dir", str(out),
                "--resume", str(path)])


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_are_refused_in_one_sentence_and_run_nothing(case, tmp_path):
    import json

    import torch

    from toolkit.checkpoint.functional import load_checkpoint, verify_checkpoint
    from toolkit.models.nets import build_model

    make, read, words = HOSTILE[case]
    path = make(tmp_path)
    if read == "manifest-outside":
        manifest = json.loads((path / "manifest.json").read_text())
        manifest["files"]["../../outside.txt"] = {"size": 1, "sha256": "0" * 64}
        (path / "manifest.json").write_text(json.dumps(manifest))
        read = verify_checkpoint
    elif read == "load":
        model = build_model("tiny", 10)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        read = lambda p: load_checkpoint(p, model=model, optimizer=optimizer)  # noqa: E731
    elif read == "resume":
        read = lambda p: resume_the_recipe(p, tmp_path / "out")  # noqa: E731

    def outside_out():
        return sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.relative_to(tmp_path).parts[0] != "out")

    before = outside_out()
    with pytest.raises(UserError) as raised:
        read(path)
    assert words in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    assert not (tmp_path / "ran").exists()
    assert outside_out() == before  # nothing written outside --output-dir


def test_a_latest_pointer_that_is_a_folder_is_ignored_with_a_warning(tmp_path, capsys):
    from toolkit.checkpoint.functional import latest_checkpoint

    path = hostile_checkpoint(tmp_path, lambda p: None)
    (path.parent / "latest").unlink(missing_ok=True)
    (path.parent / "latest").mkdir()
    assert latest_checkpoint(path.parent) == path
    assert capsys.readouterr().err == f"warning: ignoring {path.parent / 'latest'}: it does not name a checkpoint\n"
