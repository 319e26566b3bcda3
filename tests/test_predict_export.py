"""`toolkit predict` and `toolkit export` on a model trained on real handwritten digits (PNG class folders,
tests/image_folders.py): predict reproduces the run's test accuracy exactly, from the full checkpoint, from a
sharded one and from weights with wrapper prefixes alike; ONNX, TorchScript and safetensors exports agree with
PyTorch on real digit images preprocessed as their sidecar says; bad input is one sentence, exit 2."""

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import PY, ROOT, TOOLKIT, read_json, run
from image_folders import CLASSES, write_digit_folders

IMAGES = ROOT / "recipes" / "images.py"
VAL_IMAGES = 297


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny net trained 2 epochs on the digit folders (about 10 s): (digits root, run folder, summary)."""
    root = tmp_path_factory.mktemp("use")
    digits = write_digit_folders(root / "digits")
    out = root / "run"
    run([PY, IMAGES, "--data-dir", digits, "--model", "toolkit:tiny", "--image-size", 32, "--epochs", 2,
         "--global-batch-size", 64, "--augment", "none", "--workers", 1, "--output-dir", out], timeout=300)
    return digits, out, read_json(out / "summary.json")


def test_predict_on_the_val_folder_reproduces_the_runs_test_accuracy(trained, tmp_path):
    digits, out, summary = trained
    proc = run(TOOLKIT + ["predict", out / "checkpoints", digits / "val", "--out", tmp_path / "preds.csv"])
    with open(tmp_path / "preds.csv") as f:
        rows = list(csv.DictReader(f))
    # The label is the folder an image sits in, read here without toolkit code.
    correct = sum(row["class_1"] == Path(row["path"]).parent.name for row in rows)
    print(f"predict: {correct}/{len(rows)} = {correct / len(rows)}; summary.json: {summary['test_accuracy']}")
    assert len(rows) == VAL_IMAGES == summary["test_count"]
    assert correct / len(rows) == summary["test_accuracy"]
    line = f"accuracy {summary['test_accuracy']:.4f} on {VAL_IMAGES} images (labels from the folder names)"
    assert line in proc.stdout.splitlines()
    probabilities = np.array([[float(row[f"prob_{j}"]) for j in range(1, 6)] for row in rows])
    assert (np.diff(probabilities, axis=1) <= 0).all() and (probabilities.sum(1) <= 1 + 1e-5).all()
    assert all(len({row[f"class_{j}"] for j in range(1, 6)}) == 5 for row in rows)


def _save_alike(trained_out, root, sharded: bool, prefix: str = ""):
    """The trained weights and config saved again under `root`: sharded by the toolkit's own writer in this one
    process, or in the full format with every key prefixed (the state dict of a wrapped model)."""
    from toolkit.checkpoint.functional import latest_checkpoint, save_checkpoint
    from toolkit.checkpoint.functional_sharded import save_sharded_checkpoint

    source = latest_checkpoint(trained_out / "checkpoints")
    weights = safetensors.torch.load_file(source / "model.safetensors")
    state = {"config": read_json(source / "state.json")["config"]}
    if sharded:
        from toolkit.models.vision import build_image_model

        model = build_image_model("toolkit:tiny", len(CLASSES), 32)
        model.load_state_dict(weights)
        return save_sharded_checkpoint(root, 46, model=model, state=state)
    return save_checkpoint(root, 46, model={prefix + k: v for k, v in weights.items()}, state=state)


def test_a_sharded_checkpoint_and_prefixed_weights_give_identical_probabilities(trained, tmp_path):
    from toolkit.use.model import load_trained_model
    from toolkit.use.predict import image_paths, predict

    digits, out, summary = trained
    sharded = _save_alike(out, tmp_path / "sharded", sharded=True)
    wrapped = _save_alike(out, tmp_path / "wrapped", sharded=False, prefix="module._orig_mod.")
    assert (sharded / ".metadata").is_file() and not (sharded / "model.safetensors").exists()
    proc = run(TOOLKIT + ["predict", sharded, digits / "val", "--out", tmp_path / "sharded.json"])
    assert f"accuracy {summary['test_accuracy']:.4f} on {VAL_IMAGES} images" in proc.stdout
    rows = read_json(tmp_path / "sharded.json")
    assert len(rows) == VAL_IMAGES
    from_sharded = torch.tensor([[top["probability"] for top in row["top_k"]] for row in rows])
    paths = image_paths([digits / "val"])
    assert [row["path"] for row in rows] == [str(p) for p in paths]
    # The command ran on one thread (conftest.clean_env sets OMP_NUM_THREADS=1), and a conv's last bits depend on
    # how many threads share it (8 threads against 1 differ here), so these predictions take one thread too,
    # whatever this worker's earlier tests left set.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alike = [predict(load_trained_model(checkpoint), paths, top_k=5, batch_size=64)
                 for checkpoint in (out / "checkpoints", wrapped)]  # the same images, batches and top-k
    finally:
        torch.set_num_threads(threads)
    for checkpoint, (probabilities, indices) in zip((out / "checkpoints", wrapped), alike):
        assert torch.equal(probabilities.double(), from_sharded.double()), checkpoint  # bit for bit
        assert [[CLASSES[i] for i in ids] for ids in indices.tolist()] == [[t["class"] for t in row["top_k"]]
                                                                           for row in rows]


def _real_batch(digits, preprocessing, count=40):
    """Real val images prepared from an export's sidecar alone, as a user's own code would."""
    from PIL import Image
    from torchvision.transforms import v2

    steps = v2.Compose([v2.PILToTensor(), v2.Resize(preprocessing["resize_shorter_side"], antialias=True),
                        v2.CenterCrop(preprocessing["center_crop"]), v2.ToDtype(torch.float32, scale=True),
                        v2.Normalize(preprocessing["mean"], preprocessing["std"])])
    files = sorted((digits / "val").rglob("*.png"))[::7][:count]
    images = []
    for file in files:
        with Image.open(file) as image:
            images.append(steps(image.convert("RGBA" if image.mode in ("P", "LA") else image.mode).convert("RGB")))
    return torch.stack(images)


def _export(out, fmt, path):
    proc = run(TOOLKIT + ["export", out / "checkpoints", "--format", fmt, "--out", path])
    about = read_json(f"{path}.json")
    assert about["classes"] == CLASSES and about["input"]["shape"] == ["batch", 3, 32, 32]
    return proc, about


def _pytorch(out, images):
    from toolkit.use.model import load_trained_model

    with torch.no_grad():
        return load_trained_model(out / "checkpoints").model(images)


def test_the_onnx_export_agrees_with_pytorch_on_real_digits(trained, tmp_path):
    import onnxruntime

    digits, out, _ = trained
    proc, about = _export(out, "onnx", tmp_path / "digits.onnx")
    assert "max abs difference" in proc.stdout and about["checked"]["max_abs_difference"] <= 1e-4
    images = _real_batch(digits, about["preprocessing"])
    session = onnxruntime.InferenceSession(str(tmp_path / "digits.onnx"), providers=["CPUExecutionProvider"])
    reference = _pytorch(out, images)
    for batch in (images, images[:3]):  # the batch dimension is dynamic
        logits = torch.from_numpy(session.run(None, {"images": batch.numpy()})[0])
        difference = (logits - reference[:len(batch)]).abs().max().item()
        print(f"onnxruntime vs PyTorch on {len(batch)} real digits: max abs difference {difference:.2e}")
        assert difference <= 1e-4
    assert (logits.argmax(1) == reference[:3].argmax(1)).all()


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_the_torchscript_export_agrees_with_pytorch_on_real_digits(trained, tmp_path):
    digits, out, _ = trained
    _, about = _export(out, "torchscript", tmp_path / "digits.pt")
    images = _real_batch(digits, about["preprocessing"])
    with torch.no_grad():
        logits = torch.jit.load(str(tmp_path / "digits.pt"))(images)
    assert (logits - _pytorch(out, images)).abs().max().item() <= 1e-4


def test_the_safetensors_export_round_trips_through_weights(trained, tmp_path):
    from toolkit.models.vision import build_image_model, start_from_weights

    digits, out, _ = trained
    _, about = _export(out, "safetensors", tmp_path / "digits.safetensors")
    with safetensors.safe_open(tmp_path / "digits.safetensors", "pt") as f:
        metadata = f.metadata()
    assert json.loads(metadata["classes"]) == CLASSES and metadata["image_size"] == "32"
    assert json.loads(metadata["mean"]) == about["preprocessing"]["mean"]
    said = []
    model = build_image_model(metadata["model"], len(CLASSES), int(metadata["image_size"]))
    start_from_weights(model, str(tmp_path / "digits.safetensors"), said.append)  # what --weights does
    assert said and "all" in said[0]
    images = _real_batch(digits, about["preprocessing"])
    with torch.no_grad():
        assert torch.equal(model.eval()(images), _pytorch(out, images))


def test_a_missing_checkpoint_and_an_unreadable_image_are_one_sentence(trained, tmp_path):
    digits, out, _ = trained
    missing = run(TOOLKIT + ["predict", tmp_path / "nowhere", digits / "val"], check=False)
    garbage = tmp_path / "photo.png"
    garbage.write_bytes(b"\x89PNG not really an image")
    unreadable = run(TOOLKIT + ["predict", out / "checkpoints", digits / "val" / "digit_0", garbage], check=False)
    for proc, named in ((missing, tmp_path / "nowhere"), (unreadable, garbage)):
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1 and str(named) in proc.stderr, proc.stderr
        assert proc.stderr.startswith("error: ")


def test_an_export_that_differs_is_removed_and_missing_onnx_is_named(trained, tmp_path, monkeypatch):
    from toolkit.errors import RunFailure, UserError
    from toolkit.use import export

    _, out, _ = trained
    monkeypatch.setattr(export, "TOLERANCE", 0.0)  # onnxruntime's kernels differ from PyTorch's by ~1e-7
    with pytest.raises(RunFailure, match="away from PyTorch's on the same inputs") as failed:
        export.export(out / "checkpoints", "onnx", tmp_path / "strict.onnx")
    assert failed.value.exit_code == 1 and not list(tmp_path.iterdir())  # nothing kept, no sidecar
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(UserError, match=r'onnxruntime is not installed.*pip install "toolkit\[export\]"'):
        export.export(out / "checkpoints", "onnx", tmp_path / "any.onnx")
