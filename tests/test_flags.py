"""Flags and paths a user relies on that no other test runs, each checked by an outcome: --max-steps and
--eval-every decide how many steps and evaluations a 2-rank run makes, only the main process writes
checkpoints and metrics, --loader torch resumes mid-epoch on 2 ranks where the uninterrupted run goes, and
--sync-bn on CPU ranks says so once and saves the mean of the ranks' BatchNorm statistics.

One 2-rank launch (`flags_run`) carries most assertions: each launch costs ~15 s of imports here.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from digits import write_digits_cifar
from conftest import PY, ROOT, SCRIPTS, TORCHRUN, final_weights, read_json, run
from toolkit.checkpoint.functional import list_checkpoints
from toolkit.launch.launcher import free_port

CIFAR = ROOT / "recipes" / "cifar.py"
RECORD_WRITES = SCRIPTS / "record_summary_writes.py"
RECORD_BN = SCRIPTS / "record_bn_stats.py"
# Synthetic data (5000 train images) at global batch 256: 19 steps per epoch on any number of ranks. --max-steps 24 stops 5 steps into epoch 1; --eval-every 2 then evaluates once, at the last step.
MAX_STEPS, STEPS_PER_EPOCH = 24, 5000 // 256
FLAGS = ["--dataset", "synthetic", "--model", "tiny", "--epochs", 3, "--max-steps", MAX_STEPS, "--eval-every", 2,
         "--global-batch-size", 256, "--loader", "torch", "--checkpoint-every", 4, "--keep", 100, "--engine", "ddp",
         "--log-with", "tensorboard"]


def rows(out, kind):
    """Every row of `kind` in OUT/metrics.jsonl, duplicates included."""
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if row["kind"] == kind]


def launch(out, *extra, **env):
    writes = out.parent / f"{out.name}-writes.txt"
    proc = run(TORCHRUN + ["--master_port", free_port(), RECORD_WRITES, CIFAR, *FLAGS, *extra, "--output-dir", out],
               timeout=300, SUMMARY_WRITES_LOG=writes, RECORD_WRITES_UNDER=out, **env)
    return proc, writes


@pytest.fixture(scope="module")
def flags_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("flags") / "run"
    proc, writes = launch(out)
    return out, proc, writes


def test_max_steps_and_eval_every_decide_steps_and_evaluations(flags_run):
    out, proc, _ = flags_run
    summary = read_json(out / "summary.json")
    assert (summary["steps"], summary["world_size"], summary["test_count"]) == (MAX_STEPS, 2, 1000)
    epochs = rows(out, "epoch")
    # not after epoch 0 (every 2); at step 24, 5 of epoch 1's 19 steps done: epoch 1.263 in the records, and the
    # line names the step and the epoch it is in (not "epoch 1", which has ended, nor "epoch 0")
    partial = round(1 + (MAX_STEPS - STEPS_PER_EPOCH) / STEPS_PER_EPOCH, 3)
    assert [(r["step"], r["epoch"]) for r in epochs] == [(MAX_STEPS, partial)], epochs
    assert f"step {MAX_STEPS} (26% into epoch 2): test accuracy" in proc.stdout
    assert proc.stdout.count("test accuracy") == 2  # the one evaluation and the "done:" line, from rank 0 only


def test_the_start_line_says_the_threads_each_of_the_two_ranks_runs(flags_run):
    """torchrun gives each of several workers OMP_NUM_THREADS=1 (the tests set it too): the toolkit keeps it
    and the start line says so (the rule for an unset OMP_NUM_THREADS: tests/test_threads.py)."""
    _, proc, _ = flags_run
    start = [line for line in proc.stdout.splitlines() if "mixed precision" in line]
    assert len(start) == 1 and start[0].endswith("; mixed precision no; 1 thread per process (OMP_NUM_THREADS)"), start


@pytest.mark.parametrize("argv,sentence", [
    (["--epoch", "2"], "error: unrecognized arguments: --epoch 2; did you mean --epochs? (see --help)"),
    (["--global-batch", "64"], "error: unrecognized arguments: --global-batch 64; did you mean --global-batch-size? "
                               "(see --help)"),
], ids=["--epoch", "--global-batch"])
def test_an_abbreviated_flag_is_refused_in_one_sentence_naming_the_flag(argv, sentence, capsys):
    """argparse would take `--epoch 2` for `--epochs 2` without a word (allow_abbrev); every parser refuses it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cifar_recipe_abbrev", CIFAR)
    cifar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cifar)
    with pytest.raises(SystemExit) as stopped:
        cifar.main(argv + ["--dataset", "synthetic", "--model", "tiny"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [sentence]


@pytest.mark.parametrize("argv,sentence", [
    (["env", "--js"], "error: unrecognized arguments: --js; did you mean --json? (see `toolkit --help`)"),
    (["checkpoint", "consolidate", "x", "--ou", "y"],
     "error: unrecognized arguments: --ou y; did you mean --out? (see `toolkit --help`)"),
], ids=["env --js", "consolidate --ou"])
def test_the_toolkit_command_takes_no_abbreviations_either(argv, sentence, capsys):
    from toolkit import cli

    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [sentence]


def test_only_the_main_process_writes(flags_run):
    out, _, writes = flags_run
    steps = [r["step"] for r in rows(out, "step")]
    assert steps == list(range(1, MAX_STEPS + 1))  # every step once: no rank logged a second copy
    assert len((out / "steps.csv").read_text().splitlines()) == 1 + MAX_STEPS  # header + one row per step
    assert len((out / "epochs.csv").read_text().splitlines()) == 1 + 1
    assert len(writes.read_text().splitlines()) == 1  # summary.json written once
    written = Path(f"{writes}.all").read_text().splitlines()
    assert any("/checkpoints/" in line for line in written)
    assert all(line.startswith("rank=0 ") for line in written), [l for l in written if not l.startswith("rank=0 ")]
    saved = sorted(int(path.name.split("-")[1]) for path in list_checkpoints(out / "checkpoints"))
    assert saved == sorted({*range(4, MAX_STEPS + 1, 4), STEPS_PER_EPOCH}), saved  # every 4 and the epoch end


def test_tensorboard_holds_every_step_loss_and_the_config_in_one_file_from_rank_0(flags_run):
    """--log-with tensorboard on 2 ddp ranks: one event file of scalars (rank 0's; the write audit above proves no
    other rank wrote under the run folder) with every step's loss as metrics.jsonl has it, and the config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _ = flags_run
    logs = out / "logs"
    files = sorted(logs.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(files[0])).Reload()
    logged = rows(out, "step")
    # pytest 9's approx takes no nested structures (a list of pairs): the steps compare exactly, the losses as floats
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in logged]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in logged], rel=1e-6)
    assert [e.step for e in events.Scalars("test_accuracy")] == [MAX_STEPS]
    hparams = (next(logs.glob("*/hparams.yml"))).read_text()
    assert "global_batch_size: 256" in hparams and "engine: ddp" in hparams


def test_torch_loader_resumes_mid_epoch_on_two_ranks_where_the_uninterrupted_run_goes(flags_run, tmp_path):
    """Resume from the step-20 checkpoint (1 step into epoch 1) with the same command: the same losses and
    the same final weights as the uninterrupted run."""
    ref, _, _ = flags_run
    out = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoints" / "step-00000020", out / "checkpoints" / "step-00000020")
    (out / "checkpoints" / "latest").write_text("step-00000020\n")
    proc, _ = launch(out, "--resume", "auto")
    assert "resumed from" in proc.stdout and "(step 20)" in proc.stdout
    expected = {r["step"]: r["loss"] for r in rows(ref, "step")}
    got = {r["step"]: r["loss"] for r in rows(out, "step")}
    assert sorted(got) == list(range(21, MAX_STEPS + 1))
    assert [got[s] for s in got] == [expected[s] for s in got]
    expected_weights, weights = final_weights(ref, MAX_STEPS), final_weights(out, MAX_STEPS)
    assert all(torch.equal(expected_weights[k], weights[k]) for k in weights)


def test_bf16_run_trains_and_parity_names_mixed_precision_as_the_difference(tmp_path):
    """bf16, the GPU profiles' precision, on CPU: one process against 2 ddp ranks of the same global batch.
    bf16 rounds every matmul, and a different split rounds differently, so the verdict is either AGREE or
    DIFFER, EXPECTED naming mixed precision (exit 3), never an unexplained difference."""
    from conftest import CONFIGS, TOOLKIT

    proc = run(TOOLKIT + ["parity", CONFIGS / "cpu.yaml", CONFIGS / "cpu.yaml", "--engine-a", "single", "--engine-b",
                          "ddp", "--steps", 3, "--output-dir", tmp_path / "parity", "--", CIFAR, "--dataset",
                          "synthetic", "--model", "tiny", "--max-steps", 3, "--mixed-precision", "bf16",
                          "--output-dir", tmp_path / "run"], check=False, timeout=300)
    records = [read_json(tmp_path / "parity" / side / "record.json") for side in "ab"]
    assert [r["mixed_precision"] for r in records] == ["bf16", "bf16"], records
    assert all(loss == loss and loss < 10 for r in records for loss in r["losses"])  # trained: finite, sane
    assert proc.returncode in (0, 3), proc.stdout + proc.stderr[-2000:]
    if proc.returncode == 3:
        assert "verdict: DIFFER, EXPECTED" in proc.stdout and "mixed precision (A bf16, B bf16)" in proc.stdout
    print(proc.stdout.splitlines()[-1])


def test_sync_bn_on_two_cpu_ranks_says_so_once_and_saves_the_mean_of_the_ranks_statistics(tmp_path):
    """The recipe with a BatchNorm model (resnet9) and --sync-bn on 2 CPU ranks: PyTorch refuses SyncBatchNorm
    there, so the run says so in one line and averages the running statistics over ranks; the checkpoint it
    saves (and evaluates) holds that mean, computed here from each rank's statistics before the averaging."""
    out, prefix, data = tmp_path / "run", tmp_path / "bn", write_digits_cifar(tmp_path / "data", train=64, test=32)
    proc = run(TORCHRUN + ["--master_port", free_port(), RECORD_BN, CIFAR, "--dataset", "cifar10", "--data-dir", data,
                           "--model", "resnet9", "--sync-bn", "--engine", "ddp", "--global-batch-size", 16, "--epochs", 1, "--max-steps", 2, "--output-dir", out],
               timeout=300, BN_STATS_PREFIX=prefix)
    notice = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "SyncBatchNorm" in line]
    assert notice == ["[toolkit] --sync-bn: PyTorch's SyncBatchNorm needs GPUs; averaging BatchNorm running "
                      "statistics across ranks at each checkpoint and evaluation instead."], notice
    ranks = [torch.load(f"{prefix}-rank{r}-0.pt") for r in (0, 1)]
    assert not Path(f"{prefix}-rank0-1.pt").exists()  # one save (step 2), one averaging
    saved = final_weights(out, 2)
    assert len(ranks[0]) == 2 * 8 and all(not torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # diverged
    for name in ranks[0]:
        torch.testing.assert_close(saved[name], (ranks[0][name] + ranks[1][name]) / 2, rtol=0, atol=1e-6)
    assert read_json(out / "summary.json")["test_count"] == 32
