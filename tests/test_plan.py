"""`toolkit plan` and a run's own plan: the parts of a predicted peak against what torch and a real fsdp engine
hold, the ring's cost against its formula, the table and its recommendation, --micro-batch-size auto under a
memory cap, the run's check of predicted against measured, and the refusals.

The device is a written file (a made-up CPU in its own cache folder), so every figure here is the same on any
machine; benchmarks/plan_accuracy.py measures the plan against this machine.
"""

import json
from dataclasses import asdict

import pytest
import torch
from conftest import PY, ROOT, SCRIPTS, TOOLKIT, run

from toolkit.plan import workloads
from toolkit.plan.device import Device, cache_file
from toolkit.plan.memory import Setup, peak_memory
from toolkit.plan.step_time import all_reduce_seconds, communication_seconds
from toolkit.plan.table import RUNTIME, Planner
from toolkit.plan.trace import Traced

GIB = 2 ** 30
# A made-up CPU: the figures only have to be fixed, not this machine's.
DEVICE = Device(name="test CPU", kind="cpu", memory=16 * GIB, matmul_flops={16: 2e9, 256: 5e10},
                conv_flops={16: 1e10, 256: 5e10}, bandwidth=1e10, op_overhead_s=1e-5, alpha_s=1e-4, beta=1e9,
                cores=2, one_thread=0.6, source="tests/test_plan.py")


@pytest.fixture
def device_cache(tmp_path, monkeypatch):
    """A cache folder holding DEVICE as this machine's measurement, for this process and the ones it starts."""
    monkeypatch.setenv("TOOLKIT_CACHE", str(tmp_path / "cache"))
    path = cache_file()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(asdict(DEVICE)))
    return tmp_path / "cache"


def test_the_optimizer_state_is_what_torch_keeps_after_a_step():
    """AdamW keeps two moments per parameter, SGD with momentum one: counted from the real optimizer's state
    after a real step on the real model, without the plan's code."""
    for name, make in (("adamw", lambda p: torch.optim.AdamW(p, lr=1e-3)),
                       ("sgd", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))):
        work = workloads.lm("gpt-tiny", vocab=65, optimizer=name)
        model = work.build()
        optimizer = make(model.parameters())
        x, y = work.example(2)
        work.loss(model(x), y).backward()
        optimizer.step()
        kept = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if t.ndim)
        parts = peak_memory(Traced(work).at, Setup("single", 1, 4))
        assert parts["optimizer"] == kept, name
        assert kept == (2 if name == "adamw" else 1) * sum(p.nbytes for p in model.parameters())


def test_an_fsdp_rank_holds_the_share_the_plan_predicts(tmp_path):
    """A real fsdp engine over 2 processes: each rank's parameters and optimizer state after a step, against the
    plan's parts for the most loaded rank (FSDP2 gives the first ranks ceil(rows / 2) rows)."""
    out = tmp_path / "shards.json"
    run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPTS / "plan_shards.py",
         out], timeout=240)
    ranks = json.loads(out.read_text())
    work = workloads.lm("gpt-tiny", vocab=65, optimizer="adamw")
    parts = peak_memory(Traced(work).at, Setup("fsdp", 2, 4))
    whole = peak_memory(Traced(work).at, Setup("ddp", 2, 4))
    assert parts["parameters"] - parts_buffers(work) == max(r["parameters"] for r in ranks)
    assert parts["optimizer"] == max(r["optimizer"] for r in ranks)
    assert parts["optimizer"] < 0.6 * whole["optimizer"]


def parts_buffers(work) -> int:
    return sum(b.nbytes for b in work.build().buffers())


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_an_all_reduce_costs_what_a_ring_sends(ranks):
    """A ring all-reduce of S bytes over n ranks: 2(n-1) steps of alpha, and 2(n-1)/n x S bytes over beta per
    rank (scripts/allreduce_bandwidth.py's model); ddp's step costs one over the gradients' buckets."""
    size = 3e8
    expected = 2 * (ranks - 1) * DEVICE.alpha_s + 2 * (ranks - 1) / ranks * size / DEVICE.beta
    assert all_reduce_seconds(size, ranks, DEVICE) == pytest.approx(expected, rel=1e-12)
    work = workloads.lm("gpt-tiny", vocab=65)
    at = Traced(work).at
    gradients = sum(at(4).params.values())
    assert communication_seconds(at, Setup("ddp", ranks, 4), DEVICE, accumulation=3) == pytest.approx(
        2 * (ranks - 1) * DEVICE.alpha_s + 2 * (ranks - 1) / ranks * gradients / DEVICE.beta, rel=1e-12)


def plan_rows(*args):
    proc = run([*TOOLKIT, "plan", *map(str, args), "--json"], timeout=180, check=False)
    return proc, (json.loads(proc.stdout) if proc.returncode in (0, 1) and proc.stdout.strip() else None)


def test_the_table_splits_each_peak_and_recommends_the_fastest_that_fits(device_cache):
    proc, rows = plan_rows("--recipe", "lm", "--model", "gpt-mini", "--global-batch-size", 512, "--memory", 1)
    assert proc.returncode == 0, proc.stderr
    setups = {row["setup"] for row in rows}
    assert {"single", "ddp", "fsdp", "fsdp tp2", "fsdp pp2", "fsdp tp4", "fsdp pp4", "fsdp tp2xpp2",
            "fsdp dp2xtp2"} <= setups
    assert {row["checkpointing"] for row in rows} == {False, True}
    budget = 1 * GIB * 0.9 - RUNTIME["cpu"]
    for row in rows:
        assert sum(row["memory"].values()) == pytest.approx(row["peak_bytes"])
        assert sum(row["time"].values()) == pytest.approx(row["step_s"])
        assert row["fits"] == (row["peak_bytes"] <= budget)
        assert row["processes"] * row["micro_batch"] * row["accumulation"] == 512 * row["tp"] * row["pp"]
    best, fitting = rows[0], [r for r in rows if r["fits"]]
    assert best["fits"] and best["step_s"] == min(r["step_s"] for r in fitting)
    assert any(not r["fits"] for r in rows), "the cap was meant to rule some setups out"
    text = run([*TOOLKIT, "plan", "--recipe", "lm", "--model", "gpt-mini", "--global-batch-size", 512, "--memory",
                1], timeout=180).stdout
    assert f"recommended: {best['setup']} on {best['processes']} process(es), micro-batch {best['micro_batch']}" in text


def test_micro_batch_auto_picks_the_largest_that_fits_a_memory_cap_and_it_runs(device_cache, tmp_path):
    """Under --memory between the predicted needs of micro-batches 32 and 64, auto picks 32 and trains."""
    planner = Planner(workloads.lm("gpt-tiny", vocab=_vocab()), DEVICE)
    need = {m: planner.predict(Setup("single", 1, m), 64).peak for m in (32, 64)}
    cap = (RUNTIME["cpu"] + (need[32] + need[64]) / 2) / 0.9 / GIB
    proc = run([PY, ROOT / "recipes" / "lm.py", "--micro-batch-size", "auto", "--memory", cap, "--global-batch-size",
                64, "--max-steps", 3, "--output-dir", tmp_path / "run"], timeout=300)
    assert "micro-batch 32 x accumulation 2 (--micro-batch-size auto: 32, predicted peak" in proc.stdout
    assert f"64 would need {need[64] / GIB:.2f}" in proc.stdout
    assert need[64] > cap * GIB * 0.9 - RUNTIME["cpu"] >= need[32]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["micro_batch_size"] == 32 and summary["gradient_accumulation"] == 2


def _vocab() -> int:
    from toolkit.data.text import GENESIS, load_text

    return load_text(str(GENESIS)).vocab_size


def test_a_run_shows_its_predicted_peak_against_the_tensors_it_held(tmp_path):
    """The lm recipe's evaluation line and summary.json: the predicted peak against the measured one. The count
    is of torch's tensors over the second step, the same on any CPU, so the stated 20% must hold here. Measured:
    +1.01% (40,879,524 bytes against 40,470,792), the same on the AVX2 and the default kernels with a busy loop
    beside the run: tensor sizes do not depend on the kernels or the load."""
    proc = run([PY, ROOT / "recipes" / "lm.py", "--global-batch-size", 64, "--max-steps", 4, "--output-dir",
                tmp_path / "run"], timeout=300)
    assert " · plan: peak " in proc.stdout and " GiB predicted in tensors, " in proc.stdout
    plan = json.loads((tmp_path / "run" / "summary.json").read_text())["plan"]
    predicted = plan["predicted_peak_bytes"] - plan["predicted_workspace_bytes"]
    assert abs(plan["measured_peak_bytes"] / predicted - 1) <= plan["peak_error"], plan
    assert plan["predicted_step_s"] is None  # this machine was not measured in this suite's cache


@pytest.mark.parametrize("args, words", [
    (["--peak-tflops", "100"], "--peak-tflops describes a GPU together with --memory"),
    (["--processes", "two"], "--processes two: give world sizes separated by commas"),
    (["--device", "Z80"], "--device Z80: choose 'here' or one of"),
    (["--recipe", "cifar", "--model", "nope"], "--model nope: recipes/cifar.py trains"),
])
def test_a_plan_that_cannot_be_made_is_one_sentence(device_cache, args, words):
    proc = run([*TOOLKIT, "plan", *args], timeout=120, check=False)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_auto_with_too_little_memory_is_refused_in_one_sentence(tmp_path):
    proc = run([PY, ROOT / "recipes" / "lm.py", "--micro-batch-size", "auto", "--memory", 0.5, "--output-dir",
                tmp_path / "run"], timeout=180, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--micro-batch-size auto: even micro-batch 1 is predicted to need" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
