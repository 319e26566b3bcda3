"""Threads per process: torch's intra-op threads are the cores a process may run on (its CPU affinity) shared
by the processes of its machine, at least 1; OMP_NUM_THREADS, when it is a count, wins; the start line says
which. Without the rule every process ran torch's default of one thread per core of the machine: on a busy
machine `python recipes/cifar.py` ran 8-23x slower than with OMP_NUM_THREADS=1, at the same accuracy."""

import importlib.util
import os
import re

import pytest
import torch

from conftest import ROOT, SCRIPTS, TORCHRUN, run
from toolkit.launch.env import read_launch_env, threads_per_process
from toolkit.launch.launcher import free_port

RANK_1_OF_2 = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


@pytest.fixture
def cores(monkeypatch):
    """`cores(n)`: this process may run on n cores, as os.sched_getaffinity reports them (taskset, cpusets)."""
    return lambda n: monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("available,local,said", [
    (16, 2, "8 threads per process (16 cores / 2 processes)"),
    (16, 3, "5 threads per process (16 cores / 3 processes)"),
    (2, 2, "1 thread per process (2 cores / 2 processes)"),
    (1, 4, "1 thread per process (1 core / 4 processes)"),  # at least one
    (6, 1, "6 threads per process (6 cores / 1 process)"),
])
def test_the_cores_a_process_may_run_on_are_shared_by_the_processes_of_its_machine(cores, available, local, said):
    cores(available)
    env = read_launch_env({**RANK_1_OF_2, "LOCAL_WORLD_SIZE": str(local)}, ["train.py"])
    assert str(threads_per_process(env, current=64)) == said


@pytest.mark.parametrize("value,count", [("3", 3), ("4,2", 4), ("", 8), ("0", 8), ("many", 8)])
def test_omp_num_threads_wins_when_it_is_a_thread_count(cores, value, count):
    """A count (or OpenMP's nested list "4,2") is kept; what OpenMP itself ignores leaves the rule to decide."""
    cores(16)
    threads = threads_per_process(read_launch_env({**RANK_1_OF_2, "OMP_NUM_THREADS": value}, ["train.py"]), current=64)
    assert threads.count == count and (threads.reason == "OMP_NUM_THREADS") == (count != 8)


def test_a_spawned_worker_keeps_the_count_toolkit_spawn_gave_it(cores):
    """toolkit.spawn gives several workers, and a forked one, 1 thread (a forked worker's first parallel op could
    hang on its parent's OpenMP pool); build_accelerator keeps it, OMP_NUM_THREADS or not."""
    cores(16)
    env = read_launch_env({**RANK_1_OF_2, "TOOLKIT_LAUNCHER": "spawn", "OMP_NUM_THREADS": "4"}, ["train.py"])
    assert str(threads_per_process(env, current=1)) == "1 thread per process (set by toolkit.spawn)"


@pytest.mark.parametrize("engine", ["single", "accelerate"])
def test_build_accelerator_sets_the_count_and_says_it(engine, cores, monkeypatch, torch_threads):
    import toolkit
    from accelerate.state import AcceleratorState

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores(3)
    torch.set_num_threads(1)
    accelerator = toolkit.build_accelerator(engine)
    assert (torch.get_num_threads(), str(accelerator.threads)) == (3, "3 threads per process (3 cores / 1 process)")
    AcceleratorState._reset_state(True)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # torch read it at import: the toolkit makes it hold
    accelerator = toolkit.build_accelerator(engine)
    assert (torch.get_num_threads(), str(accelerator.threads)) == (5, "5 threads per process (OMP_NUM_THREADS)")
    AcceleratorState._reset_state(True)


def test_the_recipe_start_line_says_the_threads(cores, monkeypatch, torch_threads, capsys, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores(3)
    spec = importlib.util.spec_from_file_location("cifar_recipe_threads", ROOT / "recipes" / "cifar.py")
    cifar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cifar)
    cifar.main(["--dataset", "synthetic", "--model", "tiny", "--max-steps", "1", "--epochs", "1",
                "--output-dir", str(tmp_path / "run")])
    start = [line for line in capsys.readouterr().out.splitlines() if "mixed precision" in line]
    assert len(start) == 1 and start[0].endswith("; 3 threads per process (3 cores / 1 process)"), start


def test_each_of_two_ranks_runs_its_share_of_the_cores():
    """A real 2-process launch with no OMP_NUM_THREADS (torchrun would set 1: an empty value keeps it from it):
    each rank runs max(1, cores // 2) threads, from LOCAL_WORLD_SIZE and its own affinity."""
    proc = run(TORCHRUN + ["--master_port", free_port(), SCRIPTS / "threads_probe.py"], timeout=120, OMP_NUM_THREADS="")
    ranks = {}  # the two ranks' lines may interleave on the shared stdout: each is found by its shape
    for rank, count, actual, available in re.findall(r"THREADS rank=(\d+) count=(\d+) torch=(\d+) cores=(\d+) ",
                                                     proc.stdout):
        ranks[int(rank)] = (int(count), int(actual), int(available))
    assert sorted(ranks) == [0, 1], proc.stdout
    for count, actual, available in ranks.values():
        assert count == actual == max(1, available // 2), ranks
        assert f"says={count} thread" in proc.stdout and f"({available} core" in proc.stdout
