"""Accelerate's contract, as Accelerate's own tests and users exercise it: under every engine, the same
results as Accelerate's Accelerator itself ("real" below) running the same script.

(a) Accelerate's own test functions (accelerate.test_utils.scripts.test_sync) take each engine as their
    `accelerator`: test_noop_sync at world 1, test_distributed_sync(_multiple_fwd) at world 2.
(b) Three user scripts in the style of Accelerate's examples/by_feature (tests/scripts/conformance/:
    checkpointing.py, tracking.py, gradient_accumulation.py) differ only in how the Accelerator is built;
    each engine's final weights, logged values and checkpoint folders equal the real Accelerator's, and a
    world of 2 trains as a world of 1 at the same global batch.
(c) state_roundtrip.py saves under every engine and loads under every engine (the real one included), at
    world 1 and at world 2: model, optimizer, scheduler, each process's RNG and a registered object.

Launches are shared (a process start costs ~5 s here), through tests/scripts/conformance/driver.py: world 1 is
ONE python process running every engine in turn (8 launches in all); world 2 is one torchrun launch per engine,
which also loads its own folder and those of the engines launched before it, plus one load-only launch per
engine for the folders saved after its own (7 launches). World-2 launches are made when a test first needs
them, so one test alone pays only for the launches it reads.
"""

import csv
import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from conftest import PY, SCRIPTS, TORCHRUN, read_json, run

from toolkit.launch.launcher import free_port

DRIVER = SCRIPTS / "conformance" / "driver.py"
WORLD_1 = ("single", "dp", "ddp", "fsdp", "accelerate", "real")
WORLD_2 = ("real", "accelerate", "ddp", "fsdp")  # launch order: each loads its own folder and those saved before
CASES = [(1, e) for e in WORLD_1] + [(2, e) for e in WORLD_2]
ENGINE_CASES = [c for c in CASES if c[1] != "real"]
# fp32: measured 0 at world 1 and <= 6e-8 at world 2 (the order of a sum over ranks); a batch trained twice
# or a step on every micro-batch moved losses by 1e-2 (the injected bugs in tests/mutations.py).
TOL = 1e-5
# Checkpoints every 2 steps of 12, total_limit=2; the interrupted run stops after step 6 (mid-epoch 1).
KEPT_AFTER_12, KEPT_AFTER_6 = ["checkpoint_4", "checkpoint_5"], ["checkpoint_1", "checkpoint_2"]


def case_id(case):
    return f"w{case[0]}-{case[1]}"


class Launches:
    """The driver's runs at one world size, made on first use; `part(engine, name)` fails the test with the
    part's traceback (or the launch's output) when it did not run through."""

    def __init__(self, root: Path, world: int):
        self.root, self.world, self.procs = root, world, {}
        self.launched, self.loaded = [], {}

    def command(self, *args):
        if self.world == 1:
            return [PY, DRIVER, "--out", self.root, *args]
        return TORCHRUN + ["--master_port", free_port(), DRIVER, "--out", self.root, *args]

    def start(self, engine):
        """The engine's full run (world 1: every engine's, then every folder loaded under every engine)."""
        if self.world == 1:
            if not self.launched:
                self.procs["all"] = run(self.command("--engines", *WORLD_1, "--load-all"), check=False, timeout=300)
                self.launched = list(WORLD_1)
                self.loaded = {e: set(WORLD_1) for e in WORLD_1}
            return
        if engine not in self.launched:
            savers = [*self.launched, engine]  # its own folder too: it saves before it loads
            self.procs[engine] = run(self.command("--engines", engine, "--load-from", *savers), check=False,
                                     timeout=240)
            self.launched.append(engine)
            self.loaded[engine] = set(savers)

    def load_everything(self, engine):
        """Every engine's folder loaded under `engine`: a load-only launch for the folders saved after its own."""
        for other in WORLD_2 if self.world == 2 else WORLD_1:
            self.start(other)
        missing = [e for e in self.launched if e not in self.loaded[engine]]
        if missing:
            self.procs[f"{engine}-load"] = run(self.command("--engines", engine, "--phase", "load", "--load-from",
                                                            *missing), check=False, timeout=240)
            self.loaded[engine].update(missing)

    def output(self):
        return "\n".join(f"--- {name}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
                         for name, p in self.procs.items())

    def part(self, engine, name):
        """The folder of `engine`'s results, once its part `name` ran through on every process."""
        self.start(engine)
        folder = self.root / engine
        reports = sorted(folder.glob("errors-*.json"))
        if len(reports) != self.world:
            pytest.fail(f"{len(reports)} of the {engine} run's {self.world} processes wrote a report\n{self.output()}")
        for report in reports:
            errors = read_json(report)
            if name not in errors:
                pytest.fail(f"{engine}: part {name} never ran ({report.name})\n{self.output()}")
            if errors[name]:
                pytest.fail(f"{engine} ({report.name}), {name}:\n{errors[name]}")
        return folder


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    return {1: Launches(root / "w1", 1), 2: Launches(root / "w2", 2)}


def weights(path):
    return safetensors.torch.load_file(path)


def max_diff(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max().item() for k in a)


def assert_close_records(ours, theirs, path="."):
    """Equal structure, equal ints, strings, bools and Nones; floats within TOL."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{path}: {ours} != {theirs}"
        for key in theirs:
            assert_close_records(ours[key], theirs[key], f"{path}/{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{path}: {ours} != {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_close_records(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float) or isinstance(ours, float):
        assert ours == pytest.approx(theirs, abs=TOL), path
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"


# -- (a) Accelerate's own test functions --------------------------------------------------------------------
@pytest.mark.parametrize("engine", WORLD_1)
def test_accelerates_test_noop_sync_passes_at_world_1(launches, engine):
    launches[1].part(engine, "test_noop_sync")


@pytest.mark.parametrize("function", ["test_distributed_sync", "test_distributed_sync_multiple_fwd"])
@pytest.mark.parametrize("engine", WORLD_2)
def test_accelerates_distributed_sync_tests_pass_at_world_2(launches, engine, function):
    launches[2].part(engine, function)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_set_seed_device_specific_seeds_each_process_apart(launches, case):
    """Accelerate's `set_seed(seed, device_specific=True)`, called after the Accelerator is built."""
    launches[case[0]].part(case[1], "set_seed.device_specific")


@pytest.mark.parametrize("case", [c for c in ENGINE_CASES if c[1] != "accelerate"], ids=case_id)
def test_end_training_releases_the_process_group(launches, case):
    """So that the next engine in the process forms its own world (the world-1 run builds them in turn)."""
    launches[case[0]].part(case[1], "end_training.releases_group")


@pytest.mark.parametrize("engine", WORLD_2)
def test_split_batches_splits_each_global_batch_between_the_processes(launches, engine):
    batches = read_json(launches[2].part(engine, "split_batches") / "split_batches.json")
    assert batches == [list(range(i, i + 8)) for i in range(0, 32, 8)]  # the loader's batch_size is the global one


# -- (b) user scripts: checkpointing ------------------------------------------------------------------------
def checkpointing(launches, case, run_name):
    folder = launches[case[0]].part(case[1], f"checkpointing.{run_name}") / "checkpointing" / run_name
    return read_json(folder / "results.json"), weights(folder / "model.safetensors")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_checkpointing_a_mid_epoch_resume_equals_the_uninterrupted_run(launches, case):
    full, full_weights = checkpointing(launches, case, "uninterrupted")
    interrupted, _ = checkpointing(launches, case, "interrupted")
    resumed, resumed_weights = checkpointing(launches, case, "resumed")
    assert [s[0] for s in interrupted["steps"]] == list(range(1, 7))
    assert_close_records(interrupted["steps"], full["steps"][:6])
    # Steps 7..12 on the same samples (the rest of epoch 1 after skip_first_batches, then epoch 2), same losses.
    assert_close_records(resumed["steps"], full["steps"][6:])
    assert max_diff(resumed_weights, full_weights) <= TOL


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_checkpointing_names_and_prunes_checkpoint_folders_as_accelerate(launches, case):
    for run_name, kept in (("uninterrupted", KEPT_AFTER_12), ("interrupted", KEPT_AFTER_6), ("resumed", KEPT_AFTER_12)):
        assert checkpointing(launches, case, run_name)[0]["checkpoints"] == kept, run_name


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_checkpointing_trains_as_accelerate(launches, case):
    ours, our_weights = checkpointing(launches, case, "uninterrupted")
    theirs, their_weights = checkpointing(launches, (case[0], "real"), "uninterrupted")
    assert_close_records(ours, theirs)  # each step's global batch (sample indices) and loss
    assert max_diff(our_weights, their_weights) <= TOL


# -- (b) user scripts: gradient accumulation with clipping --------------------------------------------------
def accumulation(launches, case):
    folder = launches[case[0]].part(case[1], "gradient_accumulation") / "gradient_accumulation"
    return read_json(folder / "results.json"), weights(folder / "model.safetensors")


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_gradient_accumulation_with_clipping_trains_as_accelerate(launches, case):
    ours, our_weights = accumulation(launches, case)
    theirs, their_weights = accumulation(launches, (case[0], "real"))
    # 5 batches an epoch, 2 per step: the last batch of an epoch steps alone (Accelerate syncs at the loader's end).
    assert [b["sync"] for b in theirs["batches"]] == [False, True, False, True, True] * 2
    assert [b["sync"] for b in ours["batches"]] == [b["sync"] for b in theirs["batches"]]
    assert max(b["norm"] for b in theirs["batches"] if b["sync"]) > 0.5  # the clip cut at least once
    assert_close_records(ours, theirs)  # norms before clipping, learning rates, losses, evaluations
    assert [e["count"] for e in ours["evaluations"]] == [37, 37]  # the sampler's repeats not counted
    assert max_diff(our_weights, their_weights) <= TOL


# -- (b) user scripts: tracking -----------------------------------------------------------------------------
def tracked(launches, case):
    folder = launches[case[0]].part(case[1], "tracking") / "tracking"
    logs = folder / "project" / "conformance"
    jsonl = [json.loads(line) for line in (logs / "log.jsonl").read_text().splitlines()]
    with open(logs / "log.csv", newline="") as file:
        table = [{k: float(v) if v else None for k, v in row.items()} for row in csv.DictReader(file)]
    return {"jsonl": jsonl, "csv": table, "config": read_json(logs / "config.json")}, weights(
        folder / "weights" / "model.safetensors")


@pytest.mark.parametrize("case", ENGINE_CASES, ids=case_id)
def test_tracking_logs_what_accelerate_logs(launches, case):
    ours, our_weights = tracked(launches, case)
    theirs, their_weights = tracked(launches, (case[0], "real"))
    # The config, then loss and lr at steps 1..8, with the evaluation after steps 4 and 8: once each (the
    # main process alone writes).
    assert [sorted(r) for r in theirs["jsonl"]] == [["config"]] + ([["loss", "lr", "step"]] * 4 + [
        ["accuracy", "epoch", "step"]]) * 2
    assert [r.get("step") for r in ours["jsonl"]] == [None, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8]
    assert_close_records(ours, theirs)
    assert max_diff(our_weights, their_weights) <= TOL


# -- (b) world 1 and world 2 at the same global batch -------------------------------------------------------
@pytest.mark.parametrize("engine", WORLD_2)
def test_two_processes_train_as_one_at_the_same_global_batch(launches, engine):
    """The per-process batch at world 2 is half the global batch; the schedules are written in steps of the
    unprepared loader, which Accelerate ticks once per process: the same arithmetic, up to summation order."""
    one, two = (1, engine), (2, engine)
    for run_name in ("uninterrupted", "resumed"):
        assert_close_records(checkpointing(launches, two, run_name)[0], checkpointing(launches, one, run_name)[0])
        assert max_diff(checkpointing(launches, two, run_name)[1], checkpointing(launches, one, run_name)[1]) <= TOL
    assert_close_records(accumulation(launches, two)[0], accumulation(launches, one)[0])
    assert max_diff(accumulation(launches, two)[1], accumulation(launches, one)[1]) <= TOL
    assert_close_records(tracked(launches, two)[0], tracked(launches, one)[0])
    assert max_diff(tracked(launches, two)[1], tracked(launches, one)[1]) <= TOL


# -- (c) checkpoints both ways ------------------------------------------------------------------------------
PAIRS = ([(1, saver, loader) for saver in WORLD_1 for loader in WORLD_1]
         + [(2, saver, loader) for saver in WORLD_2 for loader in WORLD_2])


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"w{p[0]}-{p[1]}-to-{p[2]}")
def test_a_state_saved_under_one_engine_restores_under_another(launches, pair):
    world, saver, loader = pair
    saved = read_json(launches[world].part(saver, "state.save") / "saved.json")
    launches[world].load_everything(loader)
    loaded = read_json(launches[world].part(loader, f"state.load.{saver}") / "loaded" / f"{saver}.json")
    assert loaded["counter"] == saved["counter"] == 3  # the registered object
    assert loaded["draws"] == saved["draws"]  # every process's torch, python and numpy RNG: the next draws
    assert len({tuple(d) for d in saved["draws"]}) == world  # each process drew its own
    assert_close_records(loaded["scheduler"], saved["scheduler"])
    assert max_diff(loaded["weights"], saved["weights"]) <= TOL
    assert_close_records(loaded["optimizer"], saved["optimizer"])  # AdamW's moments and step counts
    assert max_diff(loaded["weights_after_next_step"], saved["weights_after_next_step"]) <= TOL
