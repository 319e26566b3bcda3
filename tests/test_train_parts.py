"""The parts a recipe's loop calls (toolkit/train), each on its own in one process with the single engine:
the run's schedule and position, its state across world sizes, the guard's loss check and stop, and
evaluation metrics through gather_for_metrics. The recipes run them under every launcher in the other test files."""

import json
import os
import signal
import time
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import toolkit
from toolkit.checkpoint.folder import seal
from toolkit.errors import RunFailure, UserError
from toolkit.train import EvalMetrics, TrainingConfig, TrainingRun, apply_preset, check_config, plan_batches, run_guard
from toolkit.train.resume import Resume


@pytest.fixture(scope="module")
def accelerator():
    accelerator = toolkit.build_accelerator("single")
    yield accelerator
    accelerator.end_training()


def config(tmp_path, **changes):
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5))
    return check_config(replace(cfg, **changes))


def test_the_schedule_counts_whole_optimizer_steps_and_max_steps_caps_it(accelerator, tmp_path):
    plan = plan_batches(64, 1, 16)  # accumulation 4
    run = TrainingRun(accelerator, config(tmp_path, epochs=3), plan, batches_per_epoch=39)
    assert (run.micro_per_epoch, run.steps_per_epoch, run.total_steps) == (36, 9, 27)  # 3 micro-batches left out
    capped = TrainingRun(accelerator, config(tmp_path, epochs=3, max_steps=10, resume="auto"), plan, 39)
    assert capped.total_steps == 10
    with pytest.raises(UserError, match="fewer than the 4 of one optimizer step"):
        TrainingRun(accelerator, config(tmp_path, resume="auto"), plan, batches_per_epoch=3)


def test_batches_stop_at_the_epochs_last_whole_step_and_step_done_rolls_the_epoch(accelerator, tmp_path):
    plan = plan_batches(4, 1, 2)  # accumulation 2
    run = TrainingRun(accelerator, config(tmp_path, epochs=2), plan, batches_per_epoch=5)
    loader = list(range(5))
    seen = []
    for epoch in run.epochs():
        for i, batch in enumerate(run.batches(loader)):
            seen.append((epoch, batch))
            if i % 2 == 1:  # the second micro-batch of each step completes it
                run.step_done(loss=1.0, lr=0.1)
    assert seen == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3)]  # batch 4 is half a step
    assert (run.step, run.epoch, run.batch, run.images) == (4, 2, 0, 16)


def test_the_position_maps_through_samples_to_another_world_size(accelerator, tmp_path, monkeypatch):
    """A 2-process run 6 steps into its second epoch (global batch 64, micro-batch 32: accumulation 1) resumes
    here (1 process, micro-batch 16: accumulation 4) at the same sample, with this world's accumulation."""
    state = {"step": 16, "epoch": 1, "samples_in_epoch": 6 * 64, "world_size": 2, "engine": "ddp",
             "config": {"model": "tiny"}, "attempts": [{"from_step": 0, "to_step": 16, "engine": "ddp",
                                                        "world_size": 2, "accumulation": 1, "micro_batch": 32}]}
    run = TrainingRun(accelerator, config(tmp_path, resume="auto"), plan_batches(64, 1, 16), batches_per_epoch=40)
    run._resumed_from = "a 2-process checkpoint"
    run.load_state_dict(state)
    assert (run.step, run.epoch, run.batch) == (16, 1, 24)  # 6 optimizer steps of 4 micro-batches
    assert run.plan.accumulation == 4  # derived for this world, not the checkpoint's 1 (the global batch would halve)
    # Both read the attempt's wall time from the clock: one instant for both, so that a loaded machine (8 ms between
    # the two calls, seen in CI with other processes running) cannot tell them apart.
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    saved, written = run.state_dict(), run.state_json()
    monkeypatch.undo()
    assert (saved["samples_in_epoch"], saved["world_size"], saved["config"]["seed"]) == (384, 1, 5)
    assert written == saved  # what state.json holds


def test_a_resume_continues_the_records_clock_and_keeps_every_attempt(accelerator, tmp_path):
    """A run resumed from a checkpoint written 100 s into it logs its steps from 100 s on, and its summary
    keeps the earlier attempt's figures beside its own: the wall time and throughput are the two attempts'."""
    plan = plan_batches(4, 1, 4)
    saved = {"step": 10, "epoch": 1, "samples_in_epoch": 0, "world_size": 1, "config": {"model": "tiny"},
             "attempts": [{"from_step": 0, "to_step": 10, "engine": "single", "world_size": 1, "images_per_s": 40.0,
                           "warmup_s": 1.0, "wall_time_s": 100.0, "warnings": ["[toolkit] warning: an earlier one"]}]}
    run = TrainingRun(accelerator, config(tmp_path, epochs=2, resume="auto"), plan, batches_per_epoch=10)
    run._resumed_from = "step-10"
    run.load_state_dict(saved)
    for _ in run.epochs():
        for _ in run.batches(list(range(10))):
            run.step_done(loss=1.0, lr=0.1)
    summary = run.finish({"accuracy": 0.5, "loss": 1.0, "count": 10})
    times = [float(line.split(",")[1]) for line in (tmp_path / "run" / "steps.csv").read_text().splitlines()[1:]]
    assert len(times) == 10 and 100.0 <= times[0] <= max(times) < 160.0  # the clock went on from 100 s
    earlier, this = summary["attempts"]
    assert earlier["wall_time_s"] == 100.0 and (this["from_step"], this["to_step"]) == (10, 20)
    assert summary["wall_time_s"] == pytest.approx(100.0 + this["wall_time_s"], abs=1e-3)
    assert 40.0 <= summary["images_per_s"] <= this["images_per_s"]  # both attempts' images over both's time
    assert summary["warnings"] == ["[toolkit] warning: an earlier one"]  # every attempt's, this one had none


def test_resuming_a_finished_run_reports_its_summary_and_loads_and_writes_nothing(accelerator, tmp_path, capsys):
    """The checkpoint at a run's last step, with summary.json reporting that step: the resume has nothing to load
    (resume_folder says "finished") and hands back the summary as it stands, saying so once."""
    plan = plan_batches(4, 1, 4)
    done = TrainingRun(accelerator, config(tmp_path, epochs=1), plan, batches_per_epoch=3)
    for _ in done.epochs():
        for _ in done.batches(list(range(3))):
            done.step_done(loss=1.0, lr=0.1)
    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps(done.state_json()))
    seal(folder, {})  # its manifest: a complete checkpoint folder
    done.finish({"accuracy": 0.75, "loss": 0.5, "count": 8})
    records = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    capsys.readouterr()
    again = TrainingRun(accelerator, config(tmp_path, epochs=1, resume=str(folder)), plan, batches_per_epoch=3)
    assert again.resume_folder(None, None, [again]) == Resume("finished", folder)
    assert (again.finished["steps"], again.finished["test_accuracy"]) == (3, 0.75)
    assert capsys.readouterr().out.startswith(f"{tmp_path / 'run'} already finished at step 3 (checkpoint {folder}): "
                                              "test accuracy 0.7500")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()} == records


def test_a_short_schedule_is_warned_about_at_start_unless_max_steps_cut_it_short_on_purpose(accelerator, tmp_path):
    plan = plan_batches(64, 1)
    short = TrainingRun(accelerator, config(tmp_path, epochs=1, warmup=0.0), plan, batches_per_epoch=10)
    assert len(short.warnings) == 1 and "10 optimizer steps at lr 0.04 (global batch 64) with no warm-up" in short.warnings[0]
    smoke = TrainingRun(accelerator, config(tmp_path, epochs=15, warmup=0.0, max_steps=3, resume="auto"), plan, 10)
    assert smoke.total_steps == 3 and smoke.warnings == []  # a smoke test: its evaluations are still watched


def test_a_second_run_in_a_used_output_dir_is_refused(accelerator, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(UserError, match="already holds files of another run"):
        TrainingRun(accelerator, config(tmp_path), plan_batches(64, 1), batches_per_epoch=10)


def test_the_guard_stops_on_a_nonfinite_loss_or_skips_it_and_averages_the_steps_losses(accelerator, tmp_path):
    plan = plan_batches(64, 1, 32)
    run = TrainingRun(accelerator, config(tmp_path), plan, batches_per_epoch=10)
    with run_guard(run) as guard:
        for loss in (1.0, 2.0):
            assert guard.should_backward(torch.tensor(loss)) and guard.check() == []
        assert guard.step_done() == {"loss": 1.5}
        assert guard.should_backward(torch.tensor(float("nan")))  # not read yet: backward is queued first
        with pytest.raises(RunFailure, match=r"the loss is not finite at step 1 on rank\(s\) \[0\]"):
            guard.check()
    skipping = TrainingRun(accelerator, config(tmp_path, skip_nonfinite=True, resume="auto"), plan, 10)
    with run_guard(skipping) as guard:
        assert not guard.should_backward(torch.tensor(float("inf"))) and guard.check() == []  # read already
        assert guard.should_backward(torch.tensor(3.0))
        done = guard.step_done()
        assert done["skipped_ranks"] == [0] and done["loss"] == float("inf")
        assert list(guard.step_done()) == ["loss"] and not guard._losses  # reset: nothing recorded since


def test_a_signal_is_honoured_at_the_step_boundary_with_exit_130(accelerator, tmp_path):
    run = TrainingRun(accelerator, config(tmp_path), plan_batches(64, 1), batches_per_epoch=10)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exited:
        with run_guard(run) as guard:
            os.kill(os.getpid(), signal.SIGTERM)
            assert not guard.stop_requested  # not yet agreed: the next loss check carries it to every rank
            guard.should_backward(torch.tensor(1.0))
            guard.check()
            assert guard.stop_requested
            guard.stop_if_asked()
    assert exited.value.code == 130 and signal.getsignal(signal.SIGTERM) is before


def evaluate(model, loader, accelerator, top_k=1):
    """The recipes' evaluation loop."""
    metrics = EvalMetrics(top_k)
    with torch.no_grad():
        for inputs, targets in loader:
            metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    return metrics.compute()


def test_evaluation_counts_every_sample_once_and_matches_a_plain_computation(accelerator):
    torch.manual_seed(3)
    model = torch.nn.Linear(5, 4)
    x, y = torch.randn(101, 5), torch.randint(0, 4, (101,))
    loader = accelerator.prepare(DataLoader(TensorDataset(x, y), batch_size=25))
    metrics = evaluate(model, loader, accelerator)
    with torch.no_grad():
        logits = model(x)
    assert metrics["count"] == 101
    assert metrics["accuracy"] == pytest.approx((logits.argmax(1) == y).double().mean().item(), abs=1e-12)
    assert metrics["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    top2 = evaluate(model, loader, accelerator, top_k=2)["accuracy"]
    assert top2 == pytest.approx((logits.topk(2).indices == y[:, None]).any(1).double().mean().item())
    # Next-token shapes: (batch, time, vocab) logits, each sequence's tokens averaged, then the sequences.
    tokens = torch.randint(0, 4, (7, 3))
    sequence_model = torch.nn.Sequential(torch.nn.Embedding(4, 4))
    sequences = accelerator.prepare(DataLoader(TensorDataset(tokens, tokens.roll(1, 1)), batch_size=2))
    result = evaluate(sequence_model, sequences, accelerator)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(sequence_model(tokens).reshape(-1, 4), tokens.roll(1, 1).reshape(-1))
    assert result["count"] == 7 and result["loss"] == pytest.approx(expected.item(), rel=1e-6)
