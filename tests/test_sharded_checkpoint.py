"""Sharded checkpoints (--checkpoint-format sharded) in one process, no launch: a save that fails leaves the
previous checkpoint in charge, and every bad or hostile sharded checkpoint is refused in one sentence (exit 2
from the commands) without running anything. The 2-rank save and the resume at another world size are in
tests/test_fsdp.py, where they share the full-format fsdp run they are compared with.
"""

import hashlib
import importlib.util
import json
import pickle
import shutil

import pytest
import torch
from conftest import ROOT
from hostile import CreatesFileOnLoad

from toolkit import cli
from toolkit.checkpoint.functional import latest_checkpoint, load_checkpoint
from toolkit.errors import UserError
from toolkit.models.nets import build_model
from toolkit.checkpoint.functional_sharded import save_sharded_checkpoint

spec = importlib.util.spec_from_file_location("cifar_recipe", ROOT / "recipes" / "cifar.py")
cifar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cifar)


def model_and_optimizer(classes=10):
    """`tiny` with the recipe's optimizer layout (two groups, a scheduler's initial_lr), so the recipe resumes it."""
    torch.manual_seed(0)
    model = build_model("tiny", classes)
    groups = [{"params": [p for p in model.parameters() if p.ndim > 1]},
              {"params": [p for p in model.parameters() if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer


def sharded(tmp_path, step=1, classes=10, edit_optimizer=None):
    """A real sharded checkpoint of `tiny` (one rank), after one optimizer step."""
    model, optimizer = model_and_optimizer(classes)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    if edit_optimizer:
        edit_optimizer(optimizer)
    state = {"epoch": 0, "samples_in_epoch": 0, "world_size": 1, "config": {"model": "tiny"}}
    return save_sharded_checkpoint(tmp_path / "ckpt", step, model=model, optimizer=optimizer, state=state, keep=3)


def reseal(path):
    """Rewrite the manifest to match the files as they are now: a crafted checkpoint, not a damaged one."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {f.name: {"size": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                         for f in path.iterdir() if f.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_failed_sharded_save_leaves_the_previous_checkpoint_in_charge(tmp_path, monkeypatch):
    first = sharded(tmp_path, step=1)
    from torch.distributed.checkpoint import FileSystemWriter

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    with pytest.raises(OSError, match="No space left"):  # the cause itself, not DCP's wrapper of it
        sharded(tmp_path, step=2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-00000001"]  # no temp left
    assert latest_checkpoint(tmp_path / "ckpt") == first
    manifest = json.loads((first / "manifest.json").read_text())
    assert (manifest["checkpoint_format"], manifest["step"], manifest["world_size"]) == ("sharded", 1, 1)
    assert {".metadata", "__0_0.distcp"} <= manifest["files"].keys() and "model.safetensors" not in manifest["files"]


def test_shards_that_did_not_reach_rank_0s_folder_are_refused(tmp_path, monkeypatch):
    """Node-local storage: another node's shards are written, but not where rank 0 looks (simulated here by
    moving this rank's shard away as the writer finishes). Refused in one sentence; nothing published."""
    from torch.distributed.checkpoint import FileSystemWriter

    finish = FileSystemWriter.finish

    def elsewhere(self, metadata, results):
        finish(self, metadata, results)
        shutil.move(self.path / "__0_0.distcp", tmp_path / "other-node.distcp")

    monkeypatch.setattr(FileSystemWriter, "finish", elsewhere)
    with pytest.raises(UserError, match="__0_0.distcp written by other ranks did not reach .* every rank shares"):
        sharded(tmp_path)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []


def hostile_index(tmp_path):
    path = sharded(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(CreatesFileOnLoad(tmp_path / "ran")))
    reseal(path)
    return path


def hostile_value(tmp_path):
    # torch.save pickles whatever a param_group holds; DCP would torch.load it with weights_only=False.
    return sharded(tmp_path, edit_optimizer=lambda o: o.param_groups[0].update(dampening=CreatesFileOnLoad(tmp_path / "ran")))


def truncated(tmp_path, seal=False):
    path = sharded(tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    if seal:
        reseal(path)
    return path


BAD = {  # name -> (make the checkpoint given tmp_path, words of the one sentence)
    "shard cut in half": (truncated, "is corrupt: __0_0.distcp has"),
    "shard cut in half, manifest crafted to match": (lambda t: truncated(t, seal=True), "could not be loaded"),
    "index pickling a call": (hostile_index, "it asks to run io.open"),
    "param_group value pickling a call": (hostile_value, "Refusing to load optim.param_groups.0.dampening"),
    "another model's shards (100 classes, not 10)": (lambda t: sharded(t, classes=100), "do not fit this model"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sharded_checkpoints_are_refused_in_one_sentence(case, tmp_path, capsys):
    """Each case three ways: loaded by the API, resumed by the recipe and consolidated by `toolkit checkpoint`."""
    make, words = BAD[case]
    path = make(tmp_path)
    model, optimizer = model_and_optimizer()
    with pytest.raises(UserError) as raised:
        load_checkpoint(path, model=model, optimizer=optimizer)
    assert words in str(raised.value) and "\n" not in str(raised.value), raised.value
    argv = ["--dataset", "synthetic", "--model", "tiny", "--output-dir", str(tmp_path / "out"), "--resume", str(path)]
    with pytest.raises(UserError, match=words.replace("(", r"\(").replace(")", r"\)")):
        cifar.main(argv)
    if "another model" not in case:  # consolidating needs no model: only a damaged or hostile file stops it
        capsys.readouterr()
        assert cli.main(["checkpoint", "consolidate", str(path), "--out", str(tmp_path / "full")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
        assert not (tmp_path / "full").exists()
    assert not (tmp_path / "ran").exists()  # nothing a file asked for ran


def test_unknown_checkpoint_format_and_consolidating_a_full_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as raised:
        cifar.main(["--dataset", "synthetic", "--model", "tiny", "--checkpoint-format", "zip"])
    err = capsys.readouterr().err
    assert raised.value.code == 2 and err.count("\n") == 1 and "invalid choice: 'zip'" in err, err
    full = tmp_path / "full"
    path = sharded(tmp_path)
    assert cli.main(["checkpoint", "consolidate", str(path), "--out", str(full)]) == 0
    assert cli.main(["checkpoint", "consolidate", str(full)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is already a full checkpoint" in err, err
    shutil.rmtree(full)
