"""Where a step's time and memory go (toolkit/train/cost.py, recorded by TrainingRun): each figure checked against
an independent measurement, in one process with the single engine."""

import csv
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

import toolkit
from conftest import ROOT
from toolkit.train import TrainingConfig, TrainingRun, apply_preset, check_config, plan_batches
from toolkit.train.cost import DATA_BOUND_STEPS, DeviceTimer, peak_memory_bytes

DATA_S, COMPUTE_S = 0.08, 0.04  # what the sleeping loader and the sleeping "model" take per micro-batch


@pytest.fixture(scope="module")
def accelerator():
    accelerator = toolkit.build_accelerator("single")
    yield accelerator
    accelerator.end_training()


class SleepingLoader:
    """A loader that takes DATA_S to hand out each batch, as a slow disk would."""

    def __init__(self, batches):
        self.batches, self.slept = batches, []  # each sleep as it took: a busy machine wakes a sleeper late

    def __len__(self):
        return self.batches

    def __iter__(self):
        for i in range(self.batches):
            self.slept.append(timed_sleep(DATA_S))
            yield i


def timed_sleep(seconds: float) -> float:
    started = time.monotonic()
    time.sleep(seconds)
    return time.monotonic() - started


def test_the_data_wait_is_the_time_blocked_on_the_loader_and_a_data_bound_run_is_said_once(accelerator, tmp_path,
                                                                                           capsys):
    """A loader sleeping 80 ms per micro-batch and a step sleeping 40 ms per micro-batch (accumulation 2): the
    steps' data_s add up to within 20% of 160 ms each and their compute_s of 80 ms; the run's totals and the epoch
    line split the same way; with data over half of every step, one warning after 20 steps, kept in the run's warnings."""
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5))
    cfg = check_config(replace(cfg, epochs=1))
    plan = plan_batches(4, 1, 2)  # accumulation 2
    steps = DATA_BOUND_STEPS + 2
    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=2 * steps)
    loader, computed = SleepingLoader(2 * steps), []
    for _ in run.epochs():
        for i, _ in enumerate(run.batches(loader)):
            computed.append(timed_sleep(COMPUTE_S))
            if i % 2 == 1:
                run.step_done(loss=1.0, lr=0.1)
    with open(tmp_path / "run" / "steps.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if k.endswith("_s")} for row in csv.DictReader(f)]
    data = [row["data_s"] for row in rows]
    compute = [row["compute_s"] for row in rows]
    print(f"per step: data {min(data):.4f}-{max(data):.4f} s, compute {min(compute):.4f}-{max(compute):.4f} s")
    # Against the sleeps as they took, not as asked: on a busy machine a sleeper wakes late, and the run must
    # count that time where it was spent. 20%: what lies between a sleep's end and the run's clock.
    assert sum(data) == pytest.approx(sum(loader.slept), rel=0.2) and sum(data) >= steps * 2 * DATA_S
    assert sum(compute) == pytest.approx(sum(computed), rel=0.2) and sum(compute) >= steps * 2 * COMPUTE_S
    assert run.cost.totals["data"] == pytest.approx(sum(data), abs=1e-3)
    share = int(run.cost.report().split("%")[0].removeprefix("data "))
    slept = round(100 * sum(loader.slept) / (sum(loader.slept) + sum(computed)))  # 160 of every 240 ms: 67%
    assert len(rows) == steps and abs(share - slept) <= 8, (share, slept)
    warnings = [w for w in run.warnings if "waiting for data" in w]
    assert len(warnings) == 1 and "--loader memory" in warnings[0]
    assert capsys.readouterr().out.count("waiting for data took over 50%") == 1


class FakeDevice:
    """A device that runs queued work in order: `busy(s)` queues s seconds of work, and an event's record() notes
    the device time at which the work before it is done, as a CUDA event on one stream does."""

    clock = 0.0

    @classmethod
    def busy(cls, seconds: float):
        cls.clock += seconds

    class Event:
        def record(self):
            self.at = FakeDevice.clock

        def synchronize(self):
            pass

        def elapsed_time(self, end) -> float:
            return (end.at - self.at) * 1000  # milliseconds, as torch.cuda.Event's


def test_on_a_gpu_compute_is_the_devices_time_for_the_steps_work_and_not_the_evaluations(accelerator, tmp_path):
    """Device events (a fake device here; tests/test_gpu.py times a real one) bracket each micro-batch's work from
    its arrival to the next fetch: a step of two micro-batches that queue 30 ms of device work each reports 60 ms
    of compute, whatever the host's own time, and 2 s of evaluation work between epochs lands in no step."""
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=3))
    cfg = check_config(replace(cfg, epochs=2))
    run = TrainingRun(accelerator, cfg, plan_batches(4, 1, 2), batches_per_epoch=6)
    run.cost.device_timer = DeviceTimer(event=FakeDevice.Event)
    for _ in run.epochs():
        for i, _ in enumerate(run.batches(list(range(6)))):
            FakeDevice.busy(0.03)  # the micro-batch's forward and backward, queued
            time.sleep(0.005)  # the host's own time: not the device's
            if i % 2 == 1:
                run.step_done(loss=1.0, lr=0.1)
        FakeDevice.busy(2.0)  # the evaluation's work on the device
    with open(tmp_path / "run" / "steps.csv") as f:
        compute = [float(row["compute_s"]) for row in csv.DictReader(f)]
    assert compute == pytest.approx([0.06] * 6, abs=1e-6)
    assert run.cost.totals["compute"] == pytest.approx(0.36, abs=1e-6)


def test_the_peak_memory_rises_with_a_tensor_the_process_holds():
    """In a fresh process (a test process's own peak is whatever earlier tests reached), the peak rises by the
    256 MiB tensor it then holds."""
    import subprocess
    import sys

    code = ("import torch; from toolkit.train.cost import peak_memory_bytes as peak; cpu = torch.device('cpu'); "
            "before = peak(cpu); held = torch.ones(64 * 2 ** 20); print(before, peak(cpu), float(held.sum()))")
    before, after, _ = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                 check=True, timeout=120).stdout.split())
    print(f"peak RSS {before / 2 ** 20:.0f} -> {after / 2 ** 20:.0f} MiB with a 256 MiB tensor")
    assert after - before >= 200 * 2 ** 20


def peaks_on_ranks(out_dir: str):
    """A toolkit.spawn worker: rank 1 holds 512 MiB more than rank 0; rank 0 writes what the run gathered."""
    import json
    from pathlib import Path

    accelerator = toolkit.build_accelerator()
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(Path(out_dir) / "run"), seed=5,
                                         profile_steps="1:1"))
    run = TrainingRun(accelerator, check_config(cfg), plan_batches(4, 2, 2), batches_per_epoch=4)
    for _, _ in zip(range(2), run.batches(range(4))):  # two steps, the first profiled on each rank
        torch.ones(64, 64) @ torch.ones(64, 64)
        run.step_done(loss=1.0, lr=0.1)
    held = torch.ones(128 * 2 ** 20 if accelerator.process_index == 1 else 1)  # 512 MiB on rank 1
    least, most = run.gathered_peak_memory()
    own = peak_memory_bytes(accelerator.device)  # read after: a peak only grows
    owns = accelerator.gather(torch.tensor([own]))
    if accelerator.is_main_process:
        (Path(out_dir) / "peaks.json").write_text(json.dumps({"least": least, "most": most, "owns": owns.tolist(),
                                                              "held": float(held.sum())}))


def test_the_peak_memory_is_gathered_from_every_rank(tmp_path):
    """Two gloo ranks, one holding 512 MiB more: the run's (least, most) are the two ranks' own peaks, not rank
    0's twice; and --profile-steps writes a trace on each rank."""
    import json

    toolkit.spawn(peaks_on_ranks, 2, str(tmp_path), start_method="spawn")
    peaks = json.loads((tmp_path / "peaks.json").read_text())
    print(f"peaks per rank {[p / 2 ** 20 for p in peaks['owns']]} MiB")
    # Each rank's own peak, read just after the gather: equal, or a little higher where the gather itself
    # allocated (40 KiB seen on rank 0 under ATEN_CPU_CAPABILITY=default); rank 0's peak counted twice would be
    # 512 MiB off.
    for gathered, own in zip((peaks["least"], peaks["most"]), peaks["owns"]):
        assert gathered <= own <= gathered + 2 ** 20, (peaks, gathered, own)
    assert peaks["owns"][1] - peaks["owns"][0] >= 400 * 2 ** 20
    traces = sorted(p.name for p in (tmp_path / "run" / "profile").glob("trace-*.json"))
    assert traces == ["trace-rank0-steps1-1.json", "trace-rank1-steps1-1.json"]  # --profile-steps on every rank


def test_the_flops_of_a_linear_layer_are_two_in_out_per_sample_each_way():
    """One sample through Linear(in, out): 2*in*out multiply-adds forward, as many for the weight's gradient (the
    input needs none), the same per sample at any batch; a conv net's count is the sum over its layers."""
    from toolkit.train import flops_per_sample

    for batch in (1, 5):
        assert flops_per_sample(torch.nn.Linear(96, 24), torch.zeros(batch, 96)) == 2 * (2 * 96 * 24)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    # forward 2*8*16 + 2*16*4; backward: both weights' gradients, and the input gradient of the second layer
    assert flops_per_sample(net, torch.zeros(3, 8)) == 2 * (2 * 8 * 16 + 2 * 16 * 4) + 2 * 16 * 4


def test_mfu_is_the_models_flop_rate_over_the_stated_peak_and_unknown_without_one(accelerator, tmp_path):
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5, peak_tflops=1e-6))
    run = TrainingRun(accelerator, check_config(replace(cfg, epochs=1)), plan_batches(4, 1, 4), batches_per_epoch=12,
                      flops_per_sample=100)
    for _ in run.epochs():
        for _ in run.batches(range(12)):
            time.sleep(0.01)
            run.step_done(loss=1.0, lr=0.1)
    rate = run.throughput.images_per_s
    assert run.mfu() == pytest.approx(100 * rate / 1e6, abs=1e-4) and 0 < run.mfu()
    unknown = TrainingRun(accelerator, check_config(replace(cfg, peak_tflops=None, resume="auto")), plan_batches(4, 1, 4),
                          batches_per_epoch=12, flops_per_sample=100)
    assert unknown.peak_flops is None and unknown.mfu() is None  # a CPU has no listed peak: no guess


def test_profile_steps_trace_exactly_the_steps_asked_for_and_name_the_top_ops(accelerator, tmp_path, capsys):
    """--profile-steps 2:3 over 4 steps of matrix products: one Chrome trace for this rank holding the steps' aten
    ops, and the top-10 table in the log and in profile/top-ops.txt; a window written once, not before step 2."""
    import json

    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5, profile_steps="2:3"))
    run = TrainingRun(accelerator, check_config(replace(cfg, epochs=1)), plan_batches(4, 1, 4), batches_per_epoch=4)
    weights, traced_at = torch.randn(256, 256), []
    for _ in run.epochs():
        for _ in run.batches(range(4)):
            (weights @ weights).sum()
            run.step_done(loss=1.0, lr=0.1)
            traced_at.append(sorted(p.name for p in (tmp_path / "run" / "profile").glob("*")))
    assert traced_at[:2] == [[], []] and traced_at[2] == traced_at[3] == ["top-ops.txt", "trace-rank0-steps2-3.json"]
    events = json.loads((tmp_path / "run" / "profile" / "trace-rank0-steps2-3.json").read_text())["traceEvents"]
    assert sum(event.get("name") == "aten::mm" for event in events) == 2  # steps 2 and 3's products, no others
    table = (tmp_path / "run" / "profile" / "top-ops.txt").read_text()
    assert "aten::mm" in table and capsys.readouterr().out.count("--profile-steps 2:3: one trace per rank") == 1
    run.finish({"accuracy": 0.5, "loss": 1.0, "count": 8})  # scripts/gpu_report.sh prints a run's cost with:
    lines = subprocess.run([sys.executable, ROOT / "scripts" / "cost_lines.py", tmp_path / "run"], check=True,
                           capture_output=True, text=True).stdout
    assert "time split: data" in lines and "traces: trace-rank0-steps2-3.json" in lines and "aten::mm" in lines
    with pytest.raises(toolkit.UserError, match=r"^--profile-steps 5:2: give the optimizer steps to profile as A:B "):
        check_config(replace(cfg, profile_steps="5:2"))


def test_the_time_to_the_first_step_counts_from_this_process_start(accelerator, tmp_path):
    """time_to_first_step_s is the wall time from the process's start to the run's first optimizer step. The
    start is checked on a child started at a known time: it began after that time and within a moment of it
    (psutil's create_time, from /proc/stat's boot time cut to whole seconds, can be up to a second off)."""
    from toolkit.train.cost import seconds_since_process_start

    probe = "import time, toolkit.train.cost as c; print(time.time() - c.seconds_since_process_start())"
    before = time.time()
    started = float(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                                   cwd=ROOT).stdout)
    assert before - 0.02 <= started <= before + 0.5, (started - before)
    here = time.time() - seconds_since_process_start()
    cfg, _ = apply_preset(TrainingConfig(model="tiny", output_dir=str(tmp_path / "run"), seed=5))
    run = TrainingRun(accelerator, check_config(replace(cfg, epochs=1)), plan_batches(4, 1, 4), batches_per_epoch=2)
    for _ in run.epochs():
        for _ in run.batches(range(2)):
            run.step_done(loss=1.0, lr=0.1)
            if run.step == 1:
                expected = time.time() - here
    assert run.time_to_first_step_s == pytest.approx(expected, abs=0.05)
