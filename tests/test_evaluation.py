"""Evaluation beyond accuracy and loss (toolkit/train/evaluation.py, confusion.py) and --keep-best: the
top-5, per-class accuracy and confusion matrix against a count written without the toolkit, the same counts
under 1 process and 2 gloo ranks, confusion.png and confusion.json in the run's folder, and the best checkpoint
kept beside the last --keep, across a resume."""

import csv
import json
import struct
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit
from toolkit.train import EvalMetrics, TrainingConfig, TrainingRun, apply_preset, check_config, plan_batches
from toolkit.checkpoint.functional import best_checkpoint, latest_checkpoint, list_checkpoints, read_state

CLASSES, FEATURES, SAMPLES, BATCH = 5, 6, 37, 4  # 37 over 2 ranks in batches of 4: the last batch is padded


def config(tmp_path, **changes):
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5))
    return check_config(replace(cfg, **changes))


def evaluate(model, loader, accelerator, num_classes):
    """The recipes' evaluation loop."""
    metrics = EvalMetrics(num_classes=num_classes)
    with torch.no_grad():
        for inputs, targets in loader:
            metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    return metrics.compute()


def test_the_class_figures_equal_a_count_written_without_the_toolkit():
    """Six classes with different counts, one never predicted and one with no samples, fed in batches of
    different sizes: every figure equals numpy's and sklearn's on the same logits."""
    import numpy as np
    from sklearn.metrics import confusion_matrix  # imported here: the spawned workers import this file

    g = torch.Generator().manual_seed(0)
    targets = torch.tensor([0] * 20 + [1] * 9 + [2] * 5 + [3] * 13 + [4] * 3)[torch.randperm(50, generator=g)]
    logits = torch.randn(50, 6, generator=g) + 1.5 * torch.nn.functional.one_hot(targets, 6)
    logits[:, 4] -= 10.0  # class 4 (3 samples) is never predicted; class 5 has no samples
    metrics = EvalMetrics(num_classes=6)
    for start, end in ((0, 7), (7, 8), (8, 31), (31, 50)):
        metrics.update(logits[start:end], targets[start:end])
    result = metrics.compute()

    y, scores = targets.numpy(), logits.numpy()
    predicted = scores.argmax(1)
    expected = confusion_matrix(y, predicted, labels=range(6))  # rows: true class, columns: predicted
    assert result["confusion_matrix"] == expected.tolist() and expected[:, 4].sum() == 0
    assert all(type(count) is int for row in result["confusion_matrix"] for count in row)
    support = expected.sum(1)
    assert result["per_class_accuracy"][5] is None and support[5] == 0
    assert result["per_class_accuracy"][:5] == pytest.approx((expected.diagonal() / np.maximum(support, 1))[:5].tolist())
    assert result["per_class_accuracy"][4] == 0.0 and len(set(result["per_class_accuracy"][:4])) == 4
    top5 = (np.argsort(-scores, 1)[:, :5] == y[:, None]).any(1).mean()
    assert result["top5_accuracy"] == pytest.approx(top5) and result["top5_accuracy"] < 1.0
    assert result["accuracy"] == (predicted == y).sum() / 50 and result["count"] == 50  # the float64 figure, exactly
    four = EvalMetrics(num_classes=4)
    four.update(logits[:, :4], targets.clamp(max=3))
    assert "top5_accuracy" not in four.compute()  # top-5 of 4 classes is always 1


@pytest.mark.parametrize("target", [-100, 5])
def test_a_target_outside_the_classes_is_refused_in_one_sentence(target):
    """cross_entropy skips -100 (its ignore_index: a miss counted as neither hit nor loss) and fails on a class past
    the last with its own IndexError; both are one sentence naming the target, with or without per-class figures."""
    from toolkit.errors import UserError

    for metrics in (EvalMetrics(), EvalMetrics(num_classes=5)):
        metrics.update(torch.randn(3, 5), torch.tensor([0, 4, 1]))
        with pytest.raises(UserError, match=rf"got target class {target} for logits of 5 classes; targets must be 0 "
                                            r"to 4\.$"):
            metrics.update(torch.randn(3, 5), torch.tensor([0, target, 1]))


def evaluate_tiny(accelerator) -> dict:
    """A seeded Linear model over 37 samples in batches of 4, prepared on `accelerator`; with the samples this
    rank's loader gave it (the sampler pads them to an even split), summed over ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, CLASSES)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    model, loader = accelerator.prepare(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    result = evaluate(model, loader, accelerator, CLASSES)
    local = torch.tensor([sum(len(targets) for _, targets in loader)])
    return {**result, "loaded": int(accelerator.gather(local).sum())}


def evaluate_on_ranks(out_dir: str):
    """A toolkit.spawn worker: evaluate_tiny on this world; rank 0 writes it to OUT_DIR/result.json."""
    accelerator = toolkit.build_accelerator()
    result = evaluate_tiny(accelerator)
    if accelerator.is_main_process:
        (Path(out_dir) / "result.json").write_text(json.dumps({**result, "world_size": accelerator.num_processes}))
    accelerator.wait_for_everyone()
    accelerator.end_training()


def test_two_gloo_ranks_count_what_one_process_counts(tmp_path):
    """37 samples over 2 ranks: the sampler pads to 38, gather_for_metrics drops the repeat, and the confusion
    matrix (and every other figure) is the one process's, summing to 37."""
    single = toolkit.build_accelerator("single")
    try:
        one = evaluate_tiny(single)
    finally:
        single.end_training()
    toolkit.spawn(evaluate_on_ranks, 2, str(tmp_path), start_method="spawn")
    two = json.loads((tmp_path / "result.json").read_text())
    assert (two["world_size"], two["loaded"], one["loaded"]) == (2, 38, 37)
    assert sum(map(sum, two["confusion_matrix"])) == 37 == sum(map(sum, one["confusion_matrix"])) == one["count"]
    assert two["confusion_matrix"] == one["confusion_matrix"]
    assert two["per_class_accuracy"] == one["per_class_accuracy"] and two["top5_accuracy"] == one["top5_accuracy"]
    assert (two["accuracy"], two["count"]) == (one["accuracy"], one["count"])


def test_the_picture_is_drawn_for_the_final_evaluation_a_minute_after_the_last_and_at_an_early_end(monkeypatch):
    """ConfusionPicture draws the final evaluation's matrix, or any once REDRAW_AFTER_S passed since the last
    drawing (or the start), and keeps the others; flush draws the one kept, once."""
    from toolkit.train import confusion

    drawn, now = [], [100.0]
    monkeypatch.setattr(confusion, "write_confusion", lambda path, matrix, names: drawn.append(matrix[0][0]))
    picture = confusion.ConfusionPicture("unused.png", clock=lambda: now[0])
    for seconds, count in ((10, 1), (59, 2), (60, 3), (70, 4), (119, 5)):  # seconds since the start
        now[0] = 100.0 + seconds
        picture.update([[count]], ["a"])
    assert drawn == [3]  # 60 s after the start; 4 and 5 came within the minute after it
    picture.update([[6]], ["a"], final=True)
    assert drawn == [3, 6]
    picture.update([[7]], ["a"])
    picture.flush(), picture.flush()
    assert drawn == [3, 6, 7]


def test_a_run_that_ends_before_its_final_evaluation_draws_its_last_one(tmp_path):
    """A run stopped early (a divergence stop) has its last evaluation's matrix drawn by finish()."""
    accelerator = toolkit.build_accelerator("single")
    run = TrainingRun(accelerator, config(tmp_path, epochs=3), plan_batches(4, 1, 4), batches_per_epoch=1)
    run.step, metrics = 1, evaluate_tiny(accelerator)
    run.evaluated(metrics)
    assert not (tmp_path / "run" / "confusion.png").exists()  # step 1 of 3, within the minute
    run.finish(metrics)
    assert (tmp_path / "run" / "confusion.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def assert_cells_shaded_by_count(png, matrix):
    """Each count's shade (its fraction of the largest count along the Blues scale) covers at least half of a
    cell per cell holding that count: the cells are drawn, and drawn by count (the colour bar's lines, 15 pixels
    each, cannot make up half a cell's 48 x 48)."""
    from PIL import Image

    from toolkit.train.confusion import shade

    high = max(map(max, matrix))
    image = Image.open(png).convert("RGB")
    pixels = Counter({colour: count for count, colour in image.getcolors(image.width * image.height)})
    for value, cells in Counter(count for row in matrix for count in row).items():
        assert pixels[shade(value / high)] >= cells * 48 * 48 // 2, (value, cells, pixels[shade(value / high)])
    assert shade(0.0) == (247, 251, 255) and shade(1.0) == (8, 48, 107)  # near white to matplotlib's darkest "Blues"


def test_an_evaluation_writes_confusion_png_and_json_and_the_top5_column(tmp_path):
    """confusion.png is a PNG of the final evaluation's matrix, its cells shaded by count (an earlier one within
    the minute is not drawn), confusion.json holds the counts with images.py's class names, each evaluation
    replaces it; epochs.csv, the trackers' dict, the line and summary.json carry top-5."""
    accelerator = toolkit.build_accelerator("single")
    run = TrainingRun(accelerator, config(tmp_path, epochs=2), plan_batches(4, 1, 4), batches_per_epoch=1)
    names = ["ant", "bee", "cat", "dog", "eel"]
    run.config["classes"] = names  # as recipes/images.py records them
    folder = tmp_path / "run"
    for step in (1, 2):
        run.step = step
        metrics = evaluate_tiny(accelerator)
        logged = run.evaluated(metrics)
        assert (folder / "confusion.png").exists() == (step == 2)  # step 2 of 2: the final evaluation
        assert json.loads((folder / "confusion.json").read_text())["step"] == step
    png = (folder / "confusion.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert 200 < width < 3000 and 200 < height < 3000 and 5_000 < len(png) < 1_000_000
    assert_cells_shaded_by_count(folder / "confusion.png", metrics["confusion_matrix"])
    written = json.loads((folder / "confusion.json").read_text())
    assert written == {"classes": names, "matrix": metrics["confusion_matrix"], "step": 2,
                       "per_class_accuracy": metrics["per_class_accuracy"]}
    assert logged == {"test_accuracy": metrics["accuracy"], "test_top5_accuracy": metrics["top5_accuracy"],
                      "test_loss": metrics["loss"]}
    with open(folder / "epochs.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and float(rows[1]["test_top5_accuracy"]) == metrics["top5_accuracy"]
    summary = run.finish(metrics)
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["test_confusion_matrix"] == metrics["confusion_matrix"] == summary["test_confusion_matrix"]
    assert (saved["test_top5_accuracy"], saved["test_per_class_accuracy"]) == (metrics["top5_accuracy"],
                                                                             metrics["per_class_accuracy"])
    accelerator.end_training()


def train(tmp_path, values, stop, keep_best, **changes):
    """A run of one optimizer step per epoch on the single engine whose evaluations give `values` (the metric
    --keep-best watches) in turn, saved before each as the recipes do, stopped (as if killed) after step `stop`;
    resumed from OUTPUT_DIR when changes say so. Returns the run."""
    accelerator = toolkit.build_accelerator("single")
    model = torch.nn.Linear(2, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = config(tmp_path, epochs=len(values), keep=1, keep_best=keep_best, **changes)
    run = TrainingRun(accelerator, cfg, plan_batches(4, 1, 4), batches_per_epoch=1)
    accelerator.register_for_checkpointing(run)
    if (resume := run.resume_folder(model, optimizer, [run])).action == "load_state":
        accelerator.load_state(resume.folder)
    for _ in run.epochs():
        for _ in run.batches([0]):
            run.step_done(loss=1.0, lr=0.1)
        run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder()))
        value = values[run.step - 1]
        accuracy, loss = (value, 1.0) if keep_best == "test_accuracy" else (0.5, value)
        run.evaluated({"accuracy": accuracy, "loss": loss, "count": 10})
        if run.step == stop:
            break
    accelerator.end_training()
    return run


@pytest.mark.parametrize("keep_best, values", [("test_accuracy", [0.5, 0.9, 0.6, 0.7, 0.8, 0.95]),
                                               ("test_loss", [0.5, 0.1, 0.4, 0.3, 0.2, 0.05])])
def test_keep_best_keeps_the_best_checkpoint_beyond_keep_across_resumes(tmp_path, keep_best, values):
    """--keep 1 --keep-best: step 2's evaluation is the best until step 6's. The run is stopped (as if killed)
    after step 2's evaluation, whose checkpoint was saved before it (best.json tells the resume), and after step
    4's, whose checkpoint holds the best (best.json deleted: the checkpoint alone carries it on, so step 5 does not
    take its place); --resume auto goes on from the latest, and step 2's folder outlives --keep until beaten."""
    root = tmp_path / "run" / "checkpoints"

    def best_is(step):
        about = json.loads((root / "best.json").read_text())
        assert about == {"metric": keep_best, "value": values[step - 1], "step": step, "folder": f"step-{step:08d}"}
        assert best_checkpoint(root).name == f"step-{step:08d}" == (root / "best").read_text().strip()

    run = train(tmp_path, values, stop=2, keep_best=keep_best)
    best_is(2)
    assert run.best["step"] == 2 and read_state(root / "step-00000002")["best"]["step"] == 1  # saved before eval 2
    run = train(tmp_path, values, stop=4, keep_best=keep_best, resume="auto")
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000004"]  # beyond --keep 1
    best_is(2)
    assert read_state(root / "step-00000004")["best"] == run.best == json.loads((root / "best.json").read_text())
    (root / "best.json").unlink()
    run = train(tmp_path, values, stop=5, keep_best=keep_best, resume="auto")
    assert run.first_step == 4 and run.best["step"] == 2  # resumed from the latest, not the best
    assert best_checkpoint(root).name == "step-00000002"
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002", "step-00000005"]
    train(tmp_path, values, stop=None, keep_best=keep_best, resume="auto")
    best_is(6)
    assert [p.name for p in list_checkpoints(root)] == ["step-00000006"] == [latest_checkpoint(root).name]
