"""Ray Train for real: recipes/cifar.py's main as the training function of a TorchTrainer on a local Ray cluster
of 2 CPU workers (gloo), through `toolkit.ray_train_func` and `toolkit.ray_fit` (tests/scripts/ray_cifar.py, the
driver docs/multi-node.md shows). Ray makes the process group; the run joins it, never destroys it, trains the
losses 2 torchrun ranks train, reports its checkpoints to Ray, and resumes exactly from the last one Ray restores
after a worker is killed. Skips in one line without Ray (pip install -e ".[ray]"; .ci/run installs it).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PY, ROOT, SCRIPTS, TORCHRUN, clean_env, kill_groups, read_json, run
from toolkit.launch.launcher import free_port

try:
    import ray.train  # noqa: F401
except ImportError:
    pytest.skip("Ray Train is not installed: pip install -e \".[ray]\" (.ci/run installs it)", allow_module_level=True)

CIFAR = ROOT / "recipes" / "cifar.py"
DRIVER = SCRIPTS / "ray_cifar.py"
# 12 steps at global batch 32 (2 workers x 16), a checkpoint every 2 steps.
FLAGS = ["--dataset", "synthetic", "--model", "tiny", "--max-steps", 12, "--global-batch-size", 32, "--lr", 0.05,
         "--seed", 3, "--mixed-precision", "no", "--checkpoint-every", 2]
STEPS = 12
# Ray's report waits for its controller's poll (2 s by default) at every checkpoint; its own print patch prints each
# worker line twice.
RAY_ENV = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_DEDUP_LOGS": "0"}


def losses(out) -> dict:
    """{step: loss}, the last row of each step winning (a restarted run logs the steps after its checkpoint again)."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "step"}


@pytest.fixture(scope="module")
def torchrun_losses(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun") / "run"
    run(TORCHRUN + ["--master_port", free_port(), CIFAR, *FLAGS, "--output-dir", out], timeout=240)
    return losses(out)


def start_ray(tmp_path, failures, *extra, **env):
    pids = tmp_path / "pids"
    pids.mkdir(exist_ok=True)
    log = tmp_path / "driver.log"
    proc = subprocess.Popen([str(c) for c in [PY, DRIVER, tmp_path / "ray", "run", failures, pids, *FLAGS, *extra]],
                            cwd=ROOT, env=clean_env(**RAY_ENV, **env), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log, pids


def stored_checkpoints(tmp_path) -> list[Path]:
    """The checkpoint folders in Ray's storage (RunConfig(storage_path=TMP/ray, name="run")), oldest first."""
    return sorted(path for path in (tmp_path / "ray" / "run").glob("checkpoint_*") if path.is_dir())


def finish(proc, log, timeout=300):
    try:
        code = proc.wait(timeout=timeout)
    finally:
        kill_groups([proc])  # Ray's own processes (gcs, raylet, workers) are in the driver's process group
    return code, log.read_text()


@pytest.mark.parametrize("engine", ["auto", "fsdp", "accelerate"])
def test_ray_workers_train_the_losses_of_two_torchrun_ranks_in_rays_group(torchrun_losses, tmp_path, engine):
    """`auto` picks ddp under Ray as under torchrun; fsdp and Accelerate's own Accelerator join Ray's group too."""
    out = tmp_path / "out"
    code, text = finish(*start_ray(tmp_path, 0, "--engine", engine, "--output-dir", out)[:2])
    assert code == 0, text[-5000:]
    # Same world (2), same placement, one thread each: the same kernels and the same two-rank sums, so the same
    # losses to the last bit as torchrun's ddp ranks, under each engine (measured: identical; a rank reading
    # another's data or not averaging moves them by 1e-2 or more).
    assert losses(out) == torchrun_losses
    summary = read_json(out / "summary.json")
    ran = "ddp" if engine == "auto" else engine
    assert (summary["world_size"], summary["steps"], summary["engine"]) == (2, STEPS, ran)
    assert f"engine {ran}; global batch 32 = 2 process(es) x micro-batch 16" in text
    # Ray's group survives the run on both workers (the toolkit only joined it) and still takes a collective.
    pids = tmp_path / "pids"
    assert [(pids / f"group-alive-rank{rank}").read_text() for rank in (0, 1)] == ["True", "True"]
    # Ray's Result: the final figures, beside the latest checkpoint handed over with them.
    result = json.loads(next(line for line in text.splitlines() if line.startswith("result: "))[len("result: "):])
    assert result["steps"] == STEPS and result["test_accuracy"] == summary["test_accuracy"]
    # Ray's storage: a copy of every checkpoint the run saved (steps 2 to 12, 12 again at the loop's end), then the
    # latest once more with the final figures.
    stored = [read_json(folder / "state.json")["step"] for folder in stored_checkpoints(tmp_path)]
    assert stored == [2, 4, 6, 8, 10, 12, 12, 12], stored


def test_a_killed_worker_is_restarted_by_ray_from_the_last_reported_checkpoint(torchrun_losses, tmp_path):
    """Rank 1 is killed (SIGKILL) once Ray holds a checkpoint; Ray restarts both workers (max_failures=1) and
    `ray.train.get_checkpoint()` hands the run the last reported one: the run resumes there and ends at the
    uninterrupted losses. TOOLKIT_DEBUG_STEP_MS holds each step 300 ms, so the run is still going when killed."""
    out = tmp_path / "out"
    proc, log, pids = start_ray(tmp_path, 1, "--output-dir", out, TOOLKIT_DEBUG_STEP_MS=300)
    try:
        deadline = time.monotonic() + 180
        stored = tmp_path / "ray" / "run"
        while not stored_checkpoints(tmp_path):
            assert proc.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "no checkpoint reported to Ray"
            time.sleep(0.1)
        time.sleep(1.5)  # Ray registers a reported checkpoint at its controller's next poll (0.5 s here)
        victim = int((pids / "rank1").read_text())
        os.kill(victim, signal.SIGKILL)
        killed_at = (out / "metrics.jsonl").read_text().count('"kind": "step"')  # rank 0 may be mid-line
    except BaseException:
        kill_groups([proc])
        raise
    code, text = finish(proc, log)
    assert code == 0, text[-5000:]
    assert killed_at < STEPS, "the run had ended before the kill: nothing was restarted"
    resumed = [line for line in text.splitlines() if "resumed from" in line]
    assert resumed and str(stored) in resumed[0], text[-5000:]
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == torchrun_losses
    summary = read_json(out / "summary.json")
    assert summary["steps"] == STEPS and len(summary["attempts"]) == 2
    print(f"killed rank 1 (pid {victim}) after step {killed_at}; {resumed[0].strip()}")


def test_a_user_error_under_ray_is_one_sentence_exit_2(tmp_path):
    missing = tmp_path / "nonexistent"
    code, text = finish(*start_ray(tmp_path, 0, "--dataset", "cifar10", "--data-dir", missing,
                                   "--output-dir", tmp_path / "out")[:2])
    ours = [line for line in text.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(ours) == 1, text[-5000:]
    assert ours[0].startswith(f"error: cifar10 was not found in {missing}"), ours
    assert "Traceback" not in text.split(ours[0])[1]  # nothing after the sentence
