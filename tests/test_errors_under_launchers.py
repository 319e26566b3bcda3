"""A user error under a multi-process launch: its sentence once, no Python traceback from our processes,
every rank ended (not timed out), exit 2 under `toolkit launch`; plain `accelerate launch` and torchrun
exit non-zero with their own summary naming our sentence as the root cause (torchelastic's error file).

Each launch costs ~10 s here, so each case runs under the launchers whose behaviour differs for it: rank 0
failing inside main_process_first under toolkit launch's default engine, and a check that fails on rank 1
only. A failure before the process group exists, rank 0 failing in main_process_first under plain accelerate
launch, and every rank failing after the group formed (a checkpoint of another model) are among the cases
tests/test_bad_input_launched.py runs under both launchers in one launch each.
"""

import os
import signal
import subprocess
import time

import pytest

from conftest import ACCELERATE, CONFIGS, PY, ROOT, SCRIPTS, TOOLKIT, TORCHRUN, clean_env, kill_groups, run
from toolkit.launch.launcher import free_port
from toolkit.train.checkpoint import latest_checkpoint

CIFAR = str(ROOT / "recipes" / "cifar.py")
CPU = str(CONFIGS / "cpu.yaml")
LAUNCHERS = {
    "accelerate launch": ACCELERATE + ["--config_file", CPU],
    "toolkit launch": TOOLKIT + ["launch", "--config_file", CPU],
    "toolkit launch ddp": TOOLKIT + ["launch", "--config_file", CPU, "--engine", "ddp"],
}


CASES = {  # name -> (script and args given tmp_path, the sentence's words, launchers)
    "missing data folder (rank 0 in main_process_first)": (
        lambda t: [CIFAR, "--dataset", "cifar10", "--data-dir", str(t / "nonexistent"), "--output-dir", str(t / "o")],
        "cifar10 was not found in", ["toolkit launch"]),
    "rank 1 fails inside main_process_first": (
        lambda t: [str(SCRIPTS / "rank_local_error.py"), "main-first"],
        "rank 1 cannot read its shard file", ["toolkit launch ddp"]),
    "rank 1 fails alone, rank 0 waits at a barrier": (
        lambda t: [str(SCRIPTS / "rank_local_error.py"), "alone"],
        "rank 1 cannot read its shard file", ["accelerate launch"]),
}
PAIRS = [(case, launcher) for case, (_, _, launchers) in CASES.items() for launcher in launchers]


def our_lines(proc):
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("case,launcher", PAIRS, ids=[f"{launcher}: {case}" for case, launcher in PAIRS])
def test_one_sentence_under_a_two_process_launch(case, launcher, tmp_path):
    script, words, _ = CASES[case]
    proc = run(LAUNCHERS[launcher] + script(tmp_path), check=False, timeout=150)
    output = proc.stdout + proc.stderr
    assert "not reached" not in output and "[rank" not in output, output  # no rank's traceback, no rank went on
    assert len(our_lines(proc)) == 1 and words in our_lines(proc)[0], output
    if launcher.startswith("toolkit"):
        assert proc.returncode == 2 and "Traceback" not in output, output
        assert [line for line in output.splitlines() if not line.startswith("[toolkit]")] == our_lines(proc), output
    else:  # accelerate's own summary (and its own traceback) follow; our sentence is its root cause
        assert proc.returncode != 0 and output.count("Traceback") <= 1, output
        root_cause = output.split("Root Cause")[1]
        assert "traceback : error: " in root_cause and words in root_cause, output


def test_plain_torchrun_names_our_sentence_as_the_root_cause(tmp_path):
    proc = run(TORCHRUN + ["--master_port", free_port(), CIFAR, "--dataset", "cifar10", "--data-dir",
                           tmp_path / "nonexistent", "--output-dir", tmp_path / "o"], check=False, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and len(our_lines(proc)) == 1 and "[rank" not in output, output
    assert "cifar10 was not found in" in output.split("Root Cause")[1], output


def test_python_exits_2_with_one_line(tmp_path):
    proc = run([PY, CIFAR, "--dataset", "cifar10", "--data-dir", tmp_path / "nonexistent", "--output-dir",
                tmp_path / "o"], check=False, timeout=120)
    assert proc.returncode == 2 and (proc.stdout + proc.stderr).strip().splitlines() == our_lines(proc), proc.stderr
    assert not (tmp_path / "nonexistent").exists()  # the failed download left nothing behind


def test_ctrl_c_under_toolkit_launch_saves_a_checkpoint_and_says_one_line(tmp_path):
    """Ctrl-C reaches the whole foreground process group (the launcher and both ranks): the ranks finish their
    step and save it, and toolkit launch exits 130 with the run's one line, without torchelastic's traceback
    for the signal that stopped its agent."""
    out = tmp_path / "run"
    proc = subprocess.Popen(TOOLKIT + ["launch", "--config_file", CPU, "--engine", "ddp", CIFAR, "--dataset",
                                       "synthetic", "--model", "tiny", "--epochs", "3", "--output-dir", str(out)],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        deadline = time.monotonic() + 120
        while '"step": 5,' not in ((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        kill_groups([proc])
    lines = [line for line in output.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]
    assert proc.returncode == 130 and "Traceback" not in output, output[-3000:]
    said = [line for line in lines if line.startswith("interrupted at step ")]
    assert len(said) == 1 and lines[-1] == said[0], lines  # once, and nothing after it
    step = int(said[0].split()[3].rstrip(":"))
    assert latest_checkpoint(out / "checkpoints").name == f"step-{step:08d}"
