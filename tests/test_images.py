"""recipes/images.py on a folder of real image files (scikit-learn's digits as PNG class folders mixing
grayscale, RGBA, palette and odd-sized files, tests/image_folders.py) under python, 2 accelerate ranks and 2
ddp ranks, on the same images as parquet, resumed mid-epoch, and refusing broken folders in one sentence."""

import signal
import subprocess
import time

import pytest
import safetensors.torch
import torch
from conftest import (ACCELERATE, CONFIGS, PY, ROOT, TORCHRUN, clean_env, final_weights, kill_groups, max_weight_diff,
                      read_json, run)
from image_folders import CLASSES, write_digit_folders, write_digit_parquet

from toolkit.checkpoint.functional import latest_checkpoint
from toolkit.errors import UserError
from toolkit.data.folder import open_images
from toolkit.launch.launcher import free_port
from toolkit.models.vision import build_image_model, start_from_weights

IMAGES = ROOT / "recipes" / "images.py"
FAST = ["--model", "tiny", "--image-size", "32", "--workers", "1"]  # the tiny net, seconds per epoch
BAR = 0.93  # measured: python 0.966, accelerate 0.963, ddp 0.963 after 3 epochs without augmentation
VAL_IMAGES = 297


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_digit_folders(tmp_path_factory.mktemp("digits"))


@pytest.fixture(scope="module")
def launcher_runs(folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    recipe = [IMAGES, "--data-dir", folder, *FAST, "--epochs", 3, "--augment", "none"]
    launchers = {"python": [PY], "accelerate": ACCELERATE + ["--config_file", CONFIGS / "cpu.yaml"],
                 "ddp": TORCHRUN + ["--master_port", free_port()]}
    runs = {}
    for name, launcher in launchers.items():
        proc = run(launcher + recipe + ["--output-dir", root / name], timeout=300)
        runs[name] = (root / name, proc, read_json(root / name / "summary.json"))
    return runs


def test_a_folder_of_real_images_trains_under_every_launcher(launcher_runs):
    accuracies = {name: summary["test_accuracy"] for name, (_, _, summary) in launcher_runs.items()}
    print(f"digits as PNG folders, tiny at 32px, 3 epochs: {accuracies}")
    assert all(acc >= BAR for acc in accuracies.values()), accuracies
    for name, (out, proc, summary) in launcher_runs.items():
        assert (summary["world_size"], summary["test_count"]) == (1 if name == "python" else 2, VAL_IMAGES)
        assert summary["classes"] == CLASSES and summary["steps"] == 3 * (1500 // 64)
        state = read_json(latest_checkpoint(out / "checkpoints") / "state.json")
        assert state["config"]["classes"] == CLASSES  # the checkpoint names its outputs
        assert "1500 train / 297 val images, 10 classes" in proc.stdout


@pytest.fixture(scope="module")
def parquet_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("parquet")
    data = write_digit_parquet(root / "data")
    args = [IMAGES, "--data-dir", f"hf:{data}", *FAST, "--epochs", 3, "--checkpoint-every", 10, "--keep", 10]
    run([PY, *args, "--output-dir", root / "full"], timeout=300)
    return root, args


def test_the_same_images_as_parquet_train_with_augmentation(parquet_run):
    root, _ = parquet_run
    summary = read_json(root / "full" / "summary.json")
    print(f"parquet, RandomResizedCrop + flip, 3 epochs: {summary['test_accuracy']}")
    assert summary["test_accuracy"] >= 0.7 and summary["test_count"] == VAL_IMAGES  # measured 0.848; chance 0.1
    assert summary["classes"] == CLASSES


def test_a_run_resumed_mid_epoch_ends_with_the_uninterrupted_weights(parquet_run):
    root, args = parquet_run
    # Step 10 of 23 in the first epoch; decoded in the main process this time (workers 0, not 1), so the
    # augmentation must come from the sample, not from the worker.
    start = root / "full" / "checkpoints" / "step-00000010"
    proc = run([PY, *args, "--output-dir", root / "resumed", "--resume", start, "--workers", 0], timeout=300)
    assert "resumed from" in proc.stdout
    assert max_weight_diff(final_weights(root / "resumed", 69), final_weights(root / "full", 69)) == 0


def test_an_unreadable_image_is_one_sentence_naming_it(tmp_path):
    from PIL import Image

    for name in ("a", "b"):
        (tmp_path / "train" / name).mkdir(parents=True)
        (tmp_path / "val" / name).mkdir(parents=True)
        for i in range(4):
            Image.new("RGB", (12, 12), (60 * i, 0, 0)).save(tmp_path / "train" / name / f"{i}.png")
        Image.new("RGB", (12, 12)).save(tmp_path / "val" / name / "0.png")
    broken = tmp_path / "train" / "b" / "9.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)  # a PNG signature and nothing readable
    proc = run([PY, IMAGES, "--data-dir", tmp_path, *FAST, "--global-batch-size", 4, "--epochs", 1,
                "--output-dir", tmp_path / "out"], check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {broken} is not a readable image (") and "Traceback" not in proc.stderr


def test_an_empty_class_or_different_val_classes_are_one_sentence(tmp_path):
    from PIL import Image

    for split, names in (("train", ("cat", "dog")), ("val", ("cat", "dog", "eel")), ("test", ("cat", "dog"))):
        for name in names:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("L", (9, 7)).save(tmp_path / split / name / "0.png")
    with pytest.raises(UserError, match=r"val has 1 class that .*train lacks \(eel\); both must hold"):
        open_images(str(tmp_path))
    (tmp_path / "val").rename(tmp_path / "old")  # test/ stands in for val/
    assert open_images(str(tmp_path)).classes == ["cat", "dog"]
    (tmp_path / "train" / "dog" / "0.png").unlink()
    with pytest.raises(UserError, match=r"class folder\(s\) \['dog'\] in .*train hold no image files"):
        open_images(str(tmp_path))


@pytest.mark.parametrize("name,size", [("resnet18", 32), ("efficientnet_b0", 48), ("vit_b_16", 32), ("tiny", 64)])
def test_models_run_at_any_image_size(name, size):
    model = build_image_model(name, 7, size)
    assert model(torch.zeros(2, 3, size, size)).shape == (2, 7)


def test_a_model_that_cannot_run_at_the_size_is_one_sentence():
    with pytest.raises(UserError, match=r"^alexnet does not run on 32x32 images \(.*\); pick a larger --image-size\.$"):
        build_image_model("alexnet", 10, 32)
    with pytest.raises(UserError, match="Unknown model 'resnet17'"):
        build_image_model("resnet17", 10, 32)


def test_weights_start_a_model_with_a_new_head_for_another_class_count(tmp_path):
    source = build_image_model("resnet18", 1000, 32)
    torch.save(source.state_dict(), tmp_path / "resnet18.pth")  # as torchvision publishes them
    safetensors.torch.save_file(source.state_dict(), tmp_path / "resnet18.safetensors")
    for path in (tmp_path / "resnet18.pth", tmp_path / "resnet18.safetensors"):
        said, model = [], build_image_model("resnet18", 10, 32)
        start_from_weights(model, str(path), said.append)
        assert said == [f"[toolkit] --weights {path}: new classifier head fc (1000 -> 10 classes), the rest loaded"]
        mine, theirs = model.state_dict(), source.state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if not k.startswith("fc."))
        assert mine["fc.weight"].shape == (10, 512)
    with pytest.raises(UserError, match="does not fit this model|lacks"):
        start_from_weights(build_image_model("efficientnet_b0", 10, 32), str(tmp_path / "resnet18.pth"), print)


def test_streaming_shards_count_every_val_image_once_and_an_epoch_resumes_where_it_stopped(tmp_path):
    from PIL import Image

    from toolkit.data.folder import StreamingLoader

    for i in range(9):  # 9 images: 2 ranks cannot split them evenly, so a padding sampler would repeat one
        for split in ("train", "val"):
            (tmp_path / split / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            pixels = torch.randint(0, 256, (12, 10 + i, 3), generator=torch.Generator().manual_seed(i), dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(tmp_path / split / f"c{i % 2}" / f"{i}.png")  # crops differ
    data = open_images(str(tmp_path))
    common = dict(seed=3, image_size=8, augment="crop-flip")
    shards = [list(StreamingLoader(data.val, 2, rank=r, world_size=2, train=False, workers=0, **common))
              for r in range(2)]
    whole = list(StreamingLoader(data.val, 9, rank=0, world_size=1, train=False, workers=0, **common))[0][0]
    pieces = torch.cat([x for shard in shards for x, _ in shard])
    assert len(pieces) == 9 and torch.allclose(pieces.sum(0), whole.sum(0), atol=1e-4)  # each image once
    full = StreamingLoader(data.train, 2, rank=0, world_size=1, train=True, workers=0, **common)
    full.set_epoch(1)
    epoch = list(full)
    resumed = StreamingLoader(data.train, 2, rank=0, world_size=1, train=True, workers=1, **common)
    resumed.set_epoch(1, start_batch=2)  # decoded by a worker process this time
    tail = list(resumed)
    assert len(epoch) == 4 and len(tail) == 2
    assert all(torch.equal(a, b) and torch.equal(ya, yb) for (a, ya), (b, yb) in zip(epoch[2:], tail))


def test_sigterm_to_the_launcher_stops_loader_workers_quietly_and_saves(folder, tmp_path):
    """A scheduler's SIGTERM to `accelerate launch`: torchrun passes it to each rank's process group, the
    DataLoader workers included. They leave the stop to their rank, which saves its step and exits; a
    worker killed by it made its rank raise "DataLoader worker ... is killed by signal" (a traceback each)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([str(c) for c in ACCELERATE + ["--config_file", CONFIGS / "cpu.yaml", IMAGES,
                             "--data-dir", folder, *FAST, "--output-dir", out]], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while '"step": 3,' not in ((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # the launcher alone, as `timeout` or a scheduler sends it
        output = proc.communicate(timeout=90)[0]
    finally:
        kill_groups([proc])
    assert "Traceback" not in output and "interrupted at step" in output, output[-3000:]
    assert latest_checkpoint(out / "checkpoints") is not None
