"""torch.multiprocessing launching: toolkit.spawn and Accelerate's notebook_launcher start workers whose
build_accelerator() forms the group; 2 workers train the same weights as one process and gather_for_metrics
returns every sample exactly once."""

import json
import sys

import pytest
import torch
from conftest import PY, ROOT, run
from spawn_work import SAMPLES, train

import toolkit
from toolkit.errors import RunFailure


def result(out):
    data = json.loads((out / "result.json").read_text())
    return data, {k: torch.tensor(v) for k, v in data.pop("weights").items()}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    run([PY, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import spawn_work; "
                   f"spawn_work.train({str(out)!r})"], timeout=120)
    return result(out)


def check_two_workers(out, one_process, engine, launcher):
    data, weights = result(out)
    assert (data["engine"], data["world_size"], data["launcher"]) == (engine, 2, launcher)
    assert sorted(data["gathered"]) == list(range(SAMPLES))  # every sample once: the padding was dropped
    reference_data, reference = one_process
    assert reference_data["world_size"] == 1 and reference_data["gathered"] == list(range(SAMPLES))
    assert max((weights[k] - reference[k]).abs().max().item() for k in reference) < 1e-5


def test_spawn_two_workers_train_what_one_process_trains_and_it_names_their_device(tmp_path, one_process, capfd):
    toolkit.spawn(train, 2, str(tmp_path), start_method="spawn")  # a script's default; the runner's __main__ varies
    check_two_workers(tmp_path, one_process, "ddp", "spawn")
    device = result(tmp_path)[0]["device"]  # what the workers computed on
    line = capfd.readouterr().out.splitlines()[0]
    assert line == "toolkit.spawn: 2 processes on CPU (gloo)" if device == "cpu" else (
        line.startswith("toolkit.spawn: 2 processes on CUDA GPU") and line.endswith("(nccl)")), (line, device)


def test_a_notebook_that_already_ran_torch_forks_workers_that_train_what_one_process_trains(tmp_path, one_process):
    """A notebook's __main__ has no file, so its workers are forked (a cell's function cannot be pickled). A
    matmul run before the launch started torch's OpenMP threads, which a fork does not copy: workers that
    used them waited forever."""
    cell = (f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import torch, toolkit, spawn_work\n"
            "x = torch.randn(512, 512); (x @ x).sum().item()  # an earlier cell\n"
            f"toolkit.spawn(spawn_work.train, 2, {str(tmp_path)!r})\n")
    run([PY, "-c", cell], timeout=120, OMP_NUM_THREADS=2)  # a notebook's matmul uses the cores (tests set 1)
    check_two_workers(tmp_path, one_process, "ddp", "spawn")


def test_notebook_launcher_two_workers_train_what_one_process_trains(tmp_path, one_process):
    from accelerate import notebook_launcher

    notebook_launcher(train, (str(tmp_path),), num_processes=2)
    check_two_workers(tmp_path, one_process, "accelerate", "accelerate")


def test_a_failing_worker_is_one_sentence_every_time(tmp_path):
    """Three failing launches in one script (the last one left to end it): each says exactly its one sentence on
    stderr. torch's join used to log "Terminating process N via signal SIGTERM" first, and the failing worker's
    interpreter teardown, with its process group's threads alive, aborted about one run in six with "terminate
    called without an active exception"."""
    script = tmp_path / "script.py"
    script.write_text(f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import toolkit, spawn_work\n"
                      "from toolkit.errors import RunFailure, report\n"
                      "if __name__ == '__main__':\n"
                      "    for _ in range(2):\n"
                      "        try:\n"
                      "            toolkit.spawn(spawn_work.fail_on_rank_one, 2)\n"
                      "        except RunFailure as error:\n"
                      "            report(error)\n"
                      "    toolkit.spawn(spawn_work.fail_on_rank_one, 2)\n")
    proc = run([PY, script], check=False, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == 3 * ["error: toolkit.spawn: rank 1 failed: ValueError: rank one's data "
                                            "folder is empty"], proc.stderr
    with pytest.raises(RunFailure):
        toolkit.spawn(train, 0)


def test_spawned_workers_read_as_the_spawn_launcher_and_get_ddp():
    env = toolkit.read_launch_env(environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": "29500", "TOOLKIT_LAUNCHER": "spawn"}, argv=["x"])
    assert (env.launcher, env.rank, env.world_size, toolkit.resolve_engine("auto", env)) == ("spawn", 1, 2, "ddp")


@pytest.mark.parametrize("main_file, method", [(None, "fork"), ("<stdin>", "fork"), (__file__, "spawn")])
def test_workers_are_forked_only_when_the_main_module_is_no_file(monkeypatch, main_file, method):
    """`python - < script.py` names its __main__ "<stdin>": spawn's workers could not re-import it."""
    import types

    from toolkit.launch.spawn import _default_start_method

    main = types.ModuleType("__main__")
    if main_file is not None:
        main.__file__ = main_file
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert _default_start_method() == method
