"""GPU-only defects reproduced on the CPU: CUDA reported present in-process, a CPU GradScaler standing in for
the CUDA one, and two gloo ranks for per-rank RNG state (issue 15). Each test failed before its fix."""

import threading

import pytest
import torch

from conftest import SCRIPTS, run
from toolkit.checkpoint.functional import load_checkpoint, save_checkpoint
from toolkit.launch.env import read_launch_env


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA reported present with `n` devices; nothing may really touch a GPU."""
    def install(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    return install


def _engine(name, monkeypatch, **environ):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TOOLKIT_ENGINE",
                "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    import toolkit

    return toolkit.build_accelerator(name)


def _cpu_scaler_engine(monkeypatch):
    engine = _engine("single", monkeypatch)
    engine.scaler = torch.amp.GradScaler("cpu")  # fp16 itself needs CUDA; the scaler's logic does not
    return engine


def test_fp16_step_without_backward_is_skipped_and_counted(monkeypatch):
    # Defect 4: --skip-nonfinite skipped backward, then scaler.step raised "No inf checks were recorded".
    engine = _cpu_scaler_engine(monkeypatch)
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    optimizer = engine.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    with engine.accumulate(model):
        engine.clip_grad_norm_(model.parameters(), 1.0)  # unscale_ with no gradients must not break the step
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.step_was_skipped and engine.skipped_steps == 1
    assert torch.equal(model.weight, before)
    with engine.accumulate(model):  # the next step, with a backward, trains normally
        engine.backward(model(torch.ones(3, 4)).sum())
        optimizer.step()
    assert not optimizer.step_was_skipped and engine.skipped_steps == 1
    assert not torch.equal(model.weight, before)


def test_fp16_resume_of_a_checkpoint_without_scaler_starts_a_fresh_scaler(tmp_path, capsys):
    # Defect 6: resuming a bf16/CPU checkpoint with fp16 failed with "scaler.pt does not exist".
    model = torch.nn.Linear(4, 2)
    save_checkpoint(tmp_path, 1, model=model, state={"epoch": 0})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = load_checkpoint(tmp_path, model=model, scaler=scaler)
    assert state["step"] == 1 and scaler.get_scale() == 1024.0
    assert "fresh" in capsys.readouterr().err


def test_ddp_rank_with_one_visible_gpu_uses_it(fake_cuda):
    # Defect 5: under srun --gpus-per-task=1 each rank sees one GPU, and ranks >= 1 stopped.
    from toolkit.engines.ddp import RawDDPEngine

    fake_cuda(1)
    engine = object.__new__(RawDDPEngine)
    engine.use_cpu, engine.env = False, read_launch_env(environ={"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert engine._select_device() == torch.device("cuda", 0)
    fake_cuda(2)
    engine.env = read_launch_env(environ={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"})
    with pytest.raises(Exception, match="local rank 3 has no GPU"):
        engine._select_device()


@pytest.mark.parametrize("name", ["single", "dp", "ddp"])
def test_use_cpu_wins_over_visible_gpus(name, fake_cuda, monkeypatch):
    # Defect 3: ACCELERATE_USE_CPU (a use_cpu or MULTI_CPU profile) was ignored whenever CUDA existed.
    fake_cuda(2)
    engine = _engine(name, monkeypatch, ACCELERATE_USE_CPU="true")
    try:
        assert engine.device.type == "cpu"
        if name == "ddp":
            assert torch.distributed.get_backend() == "gloo"
        if name == "dp":
            assert engine.device_ids == []
    finally:
        engine.end_training()
    assert read_launch_env(environ={"ACCELERATE_USE_CPU": "true"}).device == "cpu"


def test_cpu_profiles_launch_on_cpu_on_gpu_hosts():
    # Defect 3, launcher side: nothing set ACCELERATE_USE_CPU, and MULTI_CPU got --multi_gpu only without GPUs.
    from toolkit.launch.launcher import plan_launch
    from toolkit.launch.profiles import load_profile

    profile = load_profile("accelerate_configs/cpu.yaml")
    for engine in ("accelerate", "ddp", "single"):
        plans = [plan_launch(profile, engine, ["train.py"], gpus=gpus) for gpus in (0, 2)]
        assert all(p.env.get("ACCELERATE_USE_CPU") == "true" for p in plans), engine
    import dataclasses

    multi_cpu = dataclasses.replace(profile, distributed_type="MULTI_CPU", use_cpu=False)
    plans = [plan_launch(multi_cpu, "accelerate", ["train.py"], gpus=gpus) for gpus in (0, 2)]
    assert all("--multi_gpu" in p.command and p.env.get("ACCELERATE_USE_CPU") == "true" for p in plans)


def test_launcher_keeps_an_inherited_cuda_visible_devices():
    # A profile's gpu_ids index the GPUs this process sees; an inherited CUDA_VISIBLE_DEVICES (SLURM, a
    # scheduler) already renumbered them, so overwriting it would pick GPUs outside the allocation.
    import dataclasses

    from toolkit.launch.launcher import plan_launch
    from toolkit.launch.profiles import load_profile

    profile = dataclasses.replace(load_profile("accelerate_configs/multi_gpu.yaml"), gpu_ids="0,1")
    plan = plan_launch(profile, "ddp", ["t.py"], gpus=2, environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert plan_launch(profile, "ddp", ["t.py"], gpus=2, environ={}).env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_dp_compiled_model_is_replicated_uncompiled(fake_cuda, monkeypatch, capsys):
    # Defect 1: DataParallel's replicas of a compiled module wrote through into the original.
    from toolkit.engines.dp import DataParallelEngine

    model = torch.compile(torch.nn.Linear(4, 2))
    engine = _engine("dp", monkeypatch)
    engine.device_ids = [0, 1]  # as with two GPUs; the wrapper is checked, not run
    _two_gpu_dataparallel(fake_cuda, monkeypatch)
    wrapped = engine._wrap_model(model)
    assert isinstance(wrapped, torch.nn.DataParallel)
    assert not any(type(m).__name__ == "OptimizedModule" for m in wrapped.modules())
    assert "uncompiled" in capsys.readouterr().out
    assert DataParallelEngine is type(engine)


def test_dp_engine_refuses_to_compile_in_prepare_over_several_gpus(fake_cuda, monkeypatch):
    # Accelerator(dynamo_backend=...) would compile the module DataParallel replicates every step.
    from toolkit.errors import UserError

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    fake_cuda(2)
    with pytest.raises(UserError, match="the dp engine cannot compile over 2 GPUs"):
        toolkit_build("dp", dynamo_backend="inductor")


def toolkit_build(name, **kwargs):
    import toolkit

    return toolkit.build_accelerator(name, **kwargs)


def _two_gpu_dataparallel(fake_cuda, monkeypatch):
    fake_cuda(2)  # after the engine is built on the CPU: only DataParallel's constructor sees two GPUs
    import sys

    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "_check_balance", lambda ids: None)


def test_dp_replica_threads_keep_the_autocast_dtype(fake_cuda, monkeypatch):
    # Defect 2: DataParallel's replica threads restart autocast without a dtype (fp16 on CUDA); the dp
    # engine puts autocast, with its dtype, inside the replicated module. A fresh thread is a replica's view.
    engine = _engine("dp", monkeypatch)
    engine.mixed_precision = "bf16"
    engine.device_ids = [0, 1]
    _two_gpu_dataparallel(fake_cuda, monkeypatch)
    wrapped = engine.prepare_model(torch.nn.Linear(4, 2))
    dtypes = []
    thread = threading.Thread(target=lambda: dtypes.append(wrapped.module(torch.ones(1, 4)).dtype))
    thread.start()
    thread.join()
    assert dtypes == [torch.bfloat16]
    assert engine.unwrap_model(wrapped).__class__ is torch.nn.Linear


def test_each_rank_restores_its_own_rng_state(tmp_path):
    # Defect 9: every rank restored rank 0's RNG state (CUDA on GPUs; the CPU generator shows it here).
    from toolkit.launch.launcher import free_port

    proc = run(["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), SCRIPTS / "rng_ranks.py", tmp_path],
               timeout=120)
    assert proc.stdout.count("own rng restored") == 2, proc.stdout


@pytest.mark.parametrize("skip_nonfinite", [False, True])
def test_no_host_sync_between_the_loss_and_backward(skip_nonfinite, tmp_path, monkeypatch):
    # Defect 8: the per-step status (.tolist() of every rank's loss) ran before backward, so on a GPU the
    # host waited for the forward before it could queue the backward. Now it is read after backward is
    # queued; only --skip-nonfinite, which must know the skipping ranks before their backward, reads it first.
    import importlib.util

    from conftest import ROOT
    from toolkit.engines.base import TorchEngine

    spec = importlib.util.spec_from_file_location("cifar_recipe_syncs", ROOT / "recipes" / "cifar.py")
    cifar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cifar)
    events = []
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, _f=original: (events.append("sync"), _f(self))[1])
    original_ce, original_backward = torch.nn.functional.cross_entropy, TorchEngine.backward
    monkeypatch.setattr(torch.nn.functional, "cross_entropy",
                        lambda *a, **k: (events.append("loss"), original_ce(*a, **k))[1])
    monkeypatch.setattr(TorchEngine, "backward",
                        lambda *a, **k: (events.append("backward"), original_backward(*a, **k))[1])
    cifar.main(["--dataset", "synthetic", "--model", "tiny", "--max-steps", "3", "--epochs", "1", "--eval-every", "1",
                "--output-dir", str(tmp_path / "out"), *(["--skip-nonfinite"] if skip_nonfinite else [])])
    steps = "".join("L" if e == "loss" else "B" if e == "backward" else "s" for e in events)
    training = [i for i, c in enumerate(steps) if c == "L"][:3]  # evaluation's losses come after
    between = [steps[i + 1:steps.find("B", i)] for i in training]
    assert len(between) == 3 and steps.count("B") == 3, steps
    assert all(("s" in part) == skip_nonfinite for part in between), steps
