"""Multi-node for real: one node on each of two network hosts (tests/netns.py), 10.0.0.1 and 10.0.0.2.

Both hosts train the recipe with the shipped accelerate_configs/multi_node.yaml (2 machines x 2 processes),
started the way a user starts them: `accelerate launch ... --machine_rank R` and `toolkit launch --engine ddp
... --machine_rank R` on each host. The result must be the weights one process reaches with the same global
batch. A node that cannot reach the main node, nodes launched with different profiles, a c10d rendezvous and
a node whose worker is killed (elastic restart) are each tried for real.
"""

import json
import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import (ACCELERATE, CONFIGS, PY, ROOT, TOOLKIT, clean_env, final_weights, kill_groups, max_weight_diff,
                      read_json, run)
from netns import hosts_or_skip

CIFAR = ROOT / "recipes" / "cifar.py"
MULTI_NODE = CONFIGS / "multi_node.yaml"
# 2 hosts x 2 processes x batch 32 = the reference's one process x batch 128: 39 steps per epoch, 78 in all.
# fp32 (the profile asks for bf16): the comparison is about the math of the split, not bf16 rounding.
FLAGS = ["--dataset", "synthetic", "--model", "tiny", "--epochs", 2, "--lr", 0.05, "--seed", 0,
         "--mixed-precision", "no", "--checkpoint-every", 5]
PER_RANK, WORLD, STEPS = 32, 4, 78
# A different world size changes float rounding (a mean of four means over 32 vs one mean over 128) and 78
# steps of training amplify it: measured 7.7e-4 at the end for 2 hosts x 2 vs one process, while the first
# losses agree to ~1e-7. Ranks that do not average gradients, or skip or replay data, move the first losses
# by 1e-2 or more (tests/test_recipe.py measured the same bounds for 2 ranks on one host).
WEIGHTS_ATOL, FIRST_STEPS, FIRST_LOSSES_ATOL = 5e-3, 7, 1e-5


hosts = pytest.fixture(scope="module", name="hosts")(hosts_or_skip)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("one-host") / "run"
    run([PY, CIFAR, *FLAGS, "--global-batch-size", PER_RANK * WORLD, "--output-dir", out], timeout=240)
    return out


def losses(out):
    """{step: loss} from OUT/metrics.jsonl (a resumed run appends: the last row of a step wins)."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "step"}


def step_rows(out):
    """[(step, loss)] of every step row in OUT/metrics.jsonl, in file order: a restarted run logs the steps
    after its checkpoint a second time."""
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["loss"]) for row in rows if row["kind"] == "step"]


def check_same_training(reference, out):
    """Same first losses (to rounding) and final weights within WEIGHTS_ATOL; returns the weight diff."""
    expected, got = losses(reference), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    first = max(abs(expected[s] - got[s]) for s in range(1, FIRST_STEPS + 1))
    assert first <= FIRST_LOSSES_ATOL, f"the first {FIRST_STEPS} losses differ by {first:.2e}"
    diff = max_weight_diff(final_weights(reference, STEPS), final_weights(out, STEPS))
    assert diff <= WEIGHTS_ATOL, diff
    return first, diff


def start_on(hosts, host, cmd, log):
    return subprocess.Popen(hosts.prefix(host) + [str(c) for c in cmd], cwd=ROOT, env=clean_env(),
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs, timeout):
    """Wait for every process; kill the stragglers' process groups. Returns the exit codes."""
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(1, deadline - time.monotonic())) for proc in procs]
    finally:
        kill_groups(procs)


def on_both_hosts(hosts, tmp_path, command, timeout=240):
    """Run command(rank) on host `rank` for ranks 0 and 1 at once; returns ([exit codes], [logs])."""
    logs = [tmp_path / f"host{rank}.log" for rank in (0, 1)]
    procs = [start_on(hosts, rank, command(rank), logs[rank]) for rank in (0, 1)]
    codes = finish(procs, timeout)
    return codes, [log.read_text() for log in logs]


def toolkit_launch(profile, rank, *extra, rdzv_timeout=60):
    return TOOLKIT + ["launch", "--config_file", profile, "--engine", "ddp", "--machine_rank", rank,
                      "--rdzv_timeout", rdzv_timeout, *extra]


def error_lines(log):
    return [line for line in log.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("launcher", ["accelerate", "toolkit-ddp"])
def test_two_hosts_end_with_the_one_host_weights(hosts, reference, tmp_path, launcher):
    out = tmp_path / "run"

    def command(rank):
        recipe = [CIFAR, *FLAGS, "--global-batch-size", PER_RANK * WORLD, "--output-dir", out]
        if launcher == "accelerate":
            return ACCELERATE + ["--config_file", MULTI_NODE, "--machine_rank", rank, *recipe]
        return toolkit_launch(MULTI_NODE, rank, *recipe)

    started = time.monotonic()
    codes, logs = on_both_hosts(hosts, tmp_path, command)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    summary = read_json(out / "summary.json")
    assert summary["world_size"] == WORLD and summary["steps"] == STEPS
    first, diff = check_same_training(reference, out)
    print(f"{launcher}: 2 hosts x 2 processes in {time.monotonic() - started:.1f} s; vs one host: first "
          f"losses within {first:.1e}, final weights within {diff:.1e}")


def test_a_node_that_cannot_reach_the_main_node_says_where_and_how_long(hosts, tmp_path):
    proc = run(hosts.prefix(1) + toolkit_launch(MULTI_NODE, 1, CIFAR, rdzv_timeout=3), check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error_lines(proc.stderr) == [("error: could not reach the main node at 10.0.0.1:29500 within 3 s; start "
                                         "machine 0 first, check main_process_ip, and open that port in its firewall.")]


def test_machine_zero_on_the_wrong_host_is_refused(hosts):
    proc = run(hosts.prefix(1) + toolkit_launch(MULTI_NODE, 0, CIFAR), check=False, timeout=60)
    assert proc.returncode == 2
    assert "main_process_ip 10.0.0.1 is not an address of this host" in error_lines(proc.stderr)[0]


def profile_copy(tmp_path, name, **changes):
    config = yaml.safe_load(MULTI_NODE.read_text())
    config.update(changes)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_nodes_launched_with_different_num_machines_are_both_stopped(hosts, tmp_path):
    three = profile_copy(tmp_path, "three.yaml", num_machines=3, num_processes=6)
    codes, logs = on_both_hosts(
        hosts, tmp_path, lambda rank: toolkit_launch(MULTI_NODE if rank == 0 else three, rank, CIFAR, *FLAGS),
        timeout=90)
    expected = ("error: machine 1 (vm) was launched with num_machines 3 but machine 0 (vm) with 2; every machine "
                "must launch the same profile, engine and script.")
    for code, log in zip(codes, logs):
        assert code == 2 and [line.replace(os.uname().nodename, "vm") for line in error_lines(log)] == [expected], log


def worker_on(hosts, host, rank):
    """The training process of global `rank` on `host`."""
    for pid in hosts.pids(host):
        try:
            process = psutil.Process(pid)
            if "cifar.py" in " ".join(process.cmdline()) and process.environ().get("RANK") == str(rank):
                return process
        except psutil.NoSuchProcess:
            continue
    return None


def test_c10d_node_whose_worker_is_killed_rejoins_and_resumes(hosts, reference, tmp_path):
    """Elastic: host 1's rank-3 worker is killed (-9) mid-epoch; its agent restarts the node's workers, the
    c10d rendezvous starts a new round with both hosts, and training resumes from the latest checkpoint."""
    c10d = profile_copy(tmp_path, "c10d.yaml", rdzv_backend="c10d")
    out = tmp_path / "run"
    logs = [tmp_path / f"host{rank}.log" for rank in (0, 1)]
    recipe = [CIFAR, *FLAGS, "--global-batch-size", PER_RANK * WORLD, "--output-dir", out]
    procs = [start_on(hosts, rank, toolkit_launch(c10d, rank, "--max_restarts", 1, *recipe), logs[rank])
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        while not (out / "checkpoints" / "step-00000015").exists():
            assert all(p.poll() is None for p in procs), "\n".join(log.read_text()[-3000:] for log in logs)
            assert time.monotonic() < deadline, "step 15 not reached"
            time.sleep(0.05)
        victim = worker_on(hosts, 1, 3)
        assert victim is not None, logs[1].read_text()[-3000:]
        victim.kill()
        codes = finish(procs, 240)
    finally:
        finish(procs, 1)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n".join(text[-3000:] for text in texts)
    assert "[toolkit] restart 1: resuming from the latest checkpoint" in texts[0] and "resumed from" in texts[0]
    assert read_json(out / "summary.json")["steps"] == STEPS
    resumed_at = int(re.search(r"resumed from \S+ \(step (\d+)\)", texts[0]).group(1))
    assert resumed_at >= 15 and resumed_at % 5 == 0, resumed_at  # the latest checkpoint when the worker died
    # After the resume: the same losses as the uninterrupted one-host run, as tightly as any 4-rank run's first
    # steps match it (a resume one batch off, without momentum or schedule moves them by 1e-2 or more) ...
    expected, got = losses(reference), losses(out)
    after = range(resumed_at + 1, resumed_at + 1 + FIRST_STEPS)
    resumed = max(abs(expected[s] - got[s]) for s in after)
    assert resumed <= FIRST_LOSSES_ATOL, f"the {FIRST_STEPS} losses after resuming at {resumed_at} differ by {resumed:.2e}"
    # ... and every step the killed round had already logged past the checkpoint is replayed with its loss.
    rows = step_rows(out)
    # The second round starts where a step number does not grow, or right after the checkpoint's step when the
    # worker died before the first round logged any step past it.
    restart = next((i for i in range(1, len(rows)) if rows[i][0] <= rows[i - 1][0]),
                   next(i for i, row in enumerate(rows) if row[0] == resumed_at + 1))
    first_round, second_round = dict(rows[:restart]), dict(rows[restart:])
    assert rows[restart][0] == resumed_at + 1 and sorted(second_round) == list(range(resumed_at + 1, STEPS + 1))
    replayed = [s for s in first_round if s > resumed_at]
    worst = max((abs(first_round[s] - second_round[s]) for s in replayed), default=0.0)
    assert worst <= 1e-6, f"replayed steps {replayed} differ from the first round by {worst:.2e}"
    first, diff = check_same_training(reference, out)
    print(f"elastic restart at step {resumed_at} ({len(replayed)} steps replayed, within {worst:.1e}): vs the "
          f"uninterrupted one-host run: first losses within {first:.1e}, the {FIRST_STEPS} after the resume within "
          f"{resumed:.1e}, final weights within {diff:.1e}")


def test_allreduce_bandwidth_between_the_hosts(hosts, tmp_path):
    results = tmp_path / "bandwidth.json"
    codes, logs = on_both_hosts(hosts, tmp_path, lambda rank: toolkit_launch(
        MULTI_NODE, rank, "--num_processes", 2, ROOT / "scripts" / "allreduce_bandwidth.py", "--max-mb", 16,
        "--json", results), timeout=120)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    measured = read_json(results)
    print("\n".join(line for line in logs[0].splitlines() if "GB/s" in line or "predicted" in line
                    or line.strip()[:1].isdigit()))
    assert measured["ranks"] == 2 and measured["beta_Bps"] > 0
    assert measured["predicted_s"]["8"] < measured["predicted_s"]["64"] < measured["predicted_s"]["512"]
