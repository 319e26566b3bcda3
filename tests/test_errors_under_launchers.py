"""A user error under a multi-process launch: its sentence once, no Python traceback from our processes,
every rank ended (not timed out), exit 2 under `toolkit launch`; plain `accelerate launch` and torchrun
exit non-zero with their own summary naming our sentence as the root cause (torchelastic's error file), and
every other rank's entry naming it too (`rank 1 stopped: rank 0 failed: ...`), never a transport error.

Each launch costs ~10 s here, so each case runs under the launchers whose behaviour differs for it: rank 0
failing inside main_process_first under toolkit launch's default engine, and a check that fails on rank 1
only. A failure before the process group exists, rank 0 failing in main_process_first under plain accelerate
launch, and every rank failing after the group formed (a checkpoint of another model) are among the cases
tests/test_bad_input_launched.py runs under both launchers in one launch each.
"""

import contextlib
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import (ACCELERATE, CONFIGS, PY, ROOT, SCRIPTS, TOOLKIT, TORCHRUN, as_a_terminal_starts_it, clean_env,
                      kill_groups, run)
from toolkit.launch.launcher import free_port
from toolkit.checkpoint.functional import latest_checkpoint

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


def report_entries(output: str) -> tuple[dict, tuple | None]:
    """torchelastic's failure report: ({rank: its `traceback :` text} of every entry, (rank, text) of the root
    cause)."""
    def entries(text):
        found, rank = {}, None
        for line in text.splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "rank":
                rank = int(value.split()[0])
            elif key == "traceback" and rank is not None:
                found[rank] = value
        return found

    failures, _, root_cause = output.partition("Root Cause")
    root = entries(root_cause)
    return {**entries(failures.partition("Failures:")[2]), **root}, next(iter(root.items()), None)


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
    """Ctrl-C reaches the whole foreground process group, which holds the launcher (torchrun's workers run in
    sessions of their own); it stops both ranks with SIGTERM, they finish their step and save it, and toolkit
    launch exits 130 with the run's one line, without torchelastic's traceback for the signal that stopped its
    agent and without a line of its own (the ranks told it theirs was said)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(TOOLKIT + ["launch", "--config_file", CPU, "--engine", "ddp", CIFAR, "--dataset",
                                       "synthetic", "--model", "tiny", "--epochs", "3", "--output-dir", str(out)],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # its own group, as a terminal's foreground job
                            preexec_fn=as_a_terminal_starts_it)
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


def ignoring_sigint():
    """preexec_fn: SIGINT ignored, as a shell starts a background job (`toolkit launch ... &`) or nohup does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_an_ignored_sigint_stays_ignored_under_toolkit_launch(tmp_path):
    """POSIX: a program started with SIGINT ignored (a background job of a shell) leaves it ignored, so a Ctrl-C
    meant for the terminal's foreground job does not stop it. The launcher, its agent and both ddp ranks all keep
    training through a SIGINT to their groups, and the run ends as if none was sent."""
    import psutil

    out = tmp_path / "run"
    proc = subprocess.Popen(TOOLKIT + ["launch", "--config_file", CPU, "--engine", "ddp", CIFAR, "--dataset",
                                       "synthetic", "--model", "tiny", "--epochs", "1", "--global-batch-size", "256",
                                       "--output-dir", str(out)],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=ignoring_sigint)
    try:
        deadline = time.monotonic() + 150
        while '"step": 3,' not in ((out / "metrics.jsonl").read_text() if (out / "metrics.jsonl").exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        # the launcher's group and each worker's own session (torchrun starts them apart), as a Ctrl-C reaches all
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(process.pid), signal.SIGINT)
        output = proc.communicate(timeout=150)[0]
    finally:
        kill_groups([proc])
    assert proc.returncode == 0 and "interrupted" not in output and "Traceback" not in output, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 5000 // 256, summary  # every step of the epoch: the SIGINT changed nothing


def test_a_rank_failing_mid_step_is_named_on_every_ranks_entry_under_plain_accelerate_launch(tmp_path):
    """Rank 0 stops in step 3 with a user error (a corrupt image only it decodes) while rank 1 waits in the
    step's collective, which breaks when rank 0 exits. Rank 1 must not report the cut gloo error ("Connection
    closed by peer ... This is typically caused by a rem"), which reads as a network fault, but rank 0's
    sentence, read from the job's store; the launcher's root cause is rank 0's own entry."""
    sentence = "data/train/digit_3/0389.png is not a readable image (image file is truncated); remove or replace it."
    proc = run(LAUNCHERS["accelerate launch"] + [SCRIPTS / "fail_at_step.py", CIFAR, "--dataset", "synthetic",
                                                 "--model", "tiny", "--epochs", "1", "--output-dir", tmp_path / "o"],
               check=False, timeout=150, FAIL_RANK=0, FAIL_STEP=3, FAIL_SENTENCE=sentence)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and our_lines(proc) == [f"error: {sentence}"], output
    entries, root = report_entries(output)
    assert root == (0, f"error: {sentence}"), output
    assert entries[1] == f"rank 1 stopped: rank 0 failed: {sentence}", output
    assert not any(words in output for words in ("lost contact", "Connection", "typically caused")), output


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate launch"])
def test_a_flag_typo_is_the_root_cause_of_plain_torchrun_and_accelerate_launch(launcher, tmp_path):
    """docs/fault-tolerance.md: under plain torchrun and accelerate launch the launcher's own report names our
    sentence as its root cause, for a flag argparse refuses too (before any process group exists)."""
    command = (TORCHRUN + ["--master_port", free_port()] if launcher == "torchrun"
               else LAUNCHERS["accelerate launch"])
    proc = run(command + [CIFAR, "--engine", "ddp", "--dataset", "synthetic", "--model", "tiny", "--epochz", "2",
                          "--output-dir", tmp_path / "o"], check=False, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and len(our_lines(proc)) == 1, output
    assert "unrecognized arguments: --epochz 2" in our_lines(proc)[0], output
    _, root = report_entries(output)
    assert root is not None and root[1] == our_lines(proc)[0], output


def importing_torch(pid: int) -> bool:
    """Whether process `pid` has begun importing torch (its shared libraries are being mapped)."""
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return "site-packages/torch/lib/" in maps.read()
    except OSError:
        return False


def command_line(process) -> list[str]:
    """A process's command line; [] for one that ended meanwhile (a zombie's, an exited helper's)."""
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:
        return []


@pytest.mark.parametrize("moment,engine", [("the launcher imports torch", "ddp"),
                                           ("the workers import torch", "ddp"),
                                           ("the workers import torch", "accelerate"),
                                           ("the workers import torch", "single")])
def test_ctrl_c_while_starting_is_one_line_and_exit_130(tmp_path, moment, engine):
    """Ctrl-C before any rank trains: the launcher is still importing torch, or its workers are (KeyboardInterrupt
    tracebacks from both ranks, 38 lines, used to follow). One line, exit 130, and no worker left running. The
    single engine's one process is the launcher's child, not a torchrun agent's."""
    import psutil

    proc = subprocess.Popen(TOOLKIT + ["launch", "--config_file", CPU, "--engine", engine, CIFAR, "--dataset",
                                       "synthetic", "--model", "tiny", "--output-dir", str(tmp_path / "run")],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # its own group, as a terminal's foreground job
                            preexec_fn=as_a_terminal_starts_it)
    workers = []
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            if moment == "the workers import torch":
                workers = [child for child in psutil.Process(proc.pid).children(recursive=True)
                           if "cifar.py" in " ".join(command_line(child))]
                if len(workers) == (1 if engine == "single" else 2) and all(importing_torch(w.pid) for w in workers):
                    break
            elif importing_torch(proc.pid):
                break
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        kill_groups([proc])
    assert proc.returncode == 130 and "Traceback" not in err and out == "", err
    assert [line for line in err.splitlines() if not line.startswith("[toolkit]")] == [
        "interrupted before the run reached a step it saves at: nothing new was saved."], err
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)
