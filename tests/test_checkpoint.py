"""Checkpoints: round trips, wrapper-free weights, pruning, torn and killed saves, unsafe pickles.

Run: PYTHONPATH=. python -m pytest -q tests/test_checkpoint.py
"""
import copy
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
import torch
import torch.distributed as dist
from hostile import CreatesFileOnLoad

from toolkit.errors import UserError
from toolkit.checkpoint.weights import load_model, save_model, unwrap_model
from toolkit.checkpoint.functional import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint, verify_checkpoint
from toolkit.checkpoint.files import restore_rng, rng_state, set_rng_state, write_training_state

REPO = Path(__file__).resolve().parents[1]


def make_model(hidden=8):
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))


def make_training(seed=0, hidden=8):
    torch.manual_seed(seed)
    model = make_model(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.9 ** step)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps=2):
    for _ in range(steps):
        loss = model(torch.randn(5, 4)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def saved_keys(path):
    with safetensors.safe_open(path, "pt") as f:
        return set(f.keys())


def draws():
    return torch.rand(3), random.random(), np.random.rand()


def test_round_trip_restores_everything(tmp_path):
    model, optimizer, scheduler = make_training()
    train(model, optimizer, scheduler)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = {"epoch": 1, "position": 5, "config": {"lr": 0.1}, "world_size": 1}
    path = save_checkpoint(tmp_path, 7, model=model, optimizer=optimizer, scheduler=scheduler,
                           scaler=scaler, state=state)
    # deepcopy: optimizer.state_dict() shares tensors that later steps update in place
    expected = copy.deepcopy([model.state_dict(), optimizer.state_dict(), scheduler.state_dict(),
                              scaler.state_dict()])
    after_save = draws()

    train(model, optimizer, scheduler)  # the run goes on, then crashes; resume into new objects
    model, optimizer, scheduler = make_training(seed=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    loaded = load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler,
                             scaler=scaler)

    assert path.name == "step-00000007"
    assert loaded == {"step": 7, **state}
    assert_same([model.state_dict(), optimizer.state_dict(), scheduler.state_dict(),
                 scaler.state_dict()], expected)
    assert_same(draws(), after_save)


def test_rng_state_helpers_round_trip():
    state = rng_state()
    first = draws()
    set_rng_state(state)
    assert_same(draws(), first)


def test_a_grown_world_restores_the_saved_ranks_rng_and_says_once_that_the_rest_keep_theirs(tmp_path, capsys):
    """Saved by 2 ranks with different streams, restored by 4: ranks 0 and 1 get their own streams back; ranks 2
    and 3 keep theirs, and one line (not one per rank) says so."""
    saved = []
    for seed in (11, 12):
        torch.manual_seed(seed)
        random.seed(seed)
        saved.append(rng_state())
    write_training_state(tmp_path, "{}", rng_states=saved)
    for rank in range(4):
        torch.manual_seed(100 + rank)
        restored = restore_rng(tmp_path, rank)
        drawn = torch.rand(3)
        assert (restored is None) == (rank >= 2)
        torch.manual_seed(11 + rank if rank < 2 else 100 + rank)  # its saved stream, or its own seeded one
        assert torch.equal(drawn, torch.rand(3)), rank
    lines = capsys.readouterr().err.splitlines()
    assert lines == [f"[toolkit] {tmp_path} holds RNG states for 2 rank(s); rank 2 and above keep their seeded RNG."]


def test_tied_weights_are_saved_once_and_stay_tied(tmp_path):
    def tied():
        model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
        model[1].weight = model[0].weight
        return model

    source, target = tied(), tied()
    save_model(source, tmp_path / "m.safetensors")
    assert saved_keys(tmp_path / "m.safetensors") == {"0.weight", "0.bias", "1.bias"}
    load_model(target, tmp_path / "m.safetensors")
    assert target[1].weight is target[0].weight
    assert_same(target.state_dict(), source.state_dict())
    load_model(target, source.state_dict())  # a plain state dict with both names also loads


def test_dataparallel_checkpoint_loads_into_bare_model_and_back(tmp_path):
    wrapped = torch.nn.DataParallel(make_model())
    path = save_checkpoint(tmp_path, 1, model=wrapped)
    assert not any(k.startswith("module.") for k in saved_keys(path / "model.safetensors"))
    bare = make_model()
    load_checkpoint(path, model=bare)
    assert_same(bare.state_dict(), wrapped.module.state_dict())

    save_model(bare, tmp_path / "bare.safetensors")
    again = torch.nn.DataParallel(make_model())
    load_model(again, tmp_path / "bare.safetensors")
    assert_same(again.module.state_dict(), bare.state_dict())


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddp_checkpoint_has_no_module_prefix(tmp_path, gloo_group):
    ddp = torch.nn.parallel.DistributedDataParallel(make_model())
    path = save_checkpoint(tmp_path, 1, model=ddp)
    assert saved_keys(path / "model.safetensors") == set(make_model().state_dict())
    bare = make_model()
    load_checkpoint(path, model=bare)
    assert_same(bare.state_dict(), ddp.module.state_dict())

    other = torch.nn.parallel.DistributedDataParallel(make_model())
    load_checkpoint(save_checkpoint(tmp_path, 2, model=bare), model=other)
    assert_same(other.module.state_dict(), bare.state_dict())


def test_compiled_and_nested_wrappers_unwrap(tmp_path):
    model = make_model()
    compiled = torch.compile(model)  # never called: only the wrapper matters here
    assert unwrap_model(compiled) is model
    assert unwrap_model(torch.nn.DataParallel(torch.compile(model))) is model
    assert unwrap_model(torch.compile(torch.nn.DataParallel(model))) is model
    save_model(compiled, tmp_path / "c.safetensors")
    assert saved_keys(tmp_path / "c.safetensors") == set(model.state_dict())
    target = torch.compile(make_model())
    load_model(target, tmp_path / "c.safetensors")
    assert_same(unwrap_model(target).state_dict(), model.state_dict())


def test_legacy_prefixed_weights_load(tmp_path):
    model = make_model()
    legacy = torch.nn.DataParallel(torch.compile(model)).state_dict()
    assert all(k.startswith("module._orig_mod.") for k in legacy)
    torch.save(legacy, tmp_path / "legacy.pt")
    for source in (legacy, tmp_path / "legacy.pt"):
        target = make_model()
        load_model(target, source)
        assert_same(target.state_dict(), model.state_dict())


def test_checkpoint_from_different_model_names_the_path(tmp_path):
    path = save_checkpoint(tmp_path, 3, model=make_model(hidden=8))
    with pytest.raises(UserError, match=str(path)) as error:
        load_checkpoint(path, model=make_model(hidden=16))
    assert "0.weight" in str(error.value)
    with pytest.raises(UserError, match="missing: 3.weight"):
        load_checkpoint(path, model=torch.nn.Sequential(*make_model(), torch.nn.Linear(2, 2)))


def test_long_lists_of_keys_or_files_say_how_many_more(tmp_path):
    """A message that shortens a list says so ("… and N more"): the missing keys of a bigger model, the foreign
    files of a folder save_state would replace."""
    import toolkit

    path = save_checkpoint(tmp_path / "c", 3, model=make_model())
    bigger = torch.nn.Sequential(*make_model(), *(torch.nn.Linear(2, 2) for _ in range(3)))
    with pytest.raises(UserError, match=r"missing: 3\.weight, 3\.bias, 4\.weight, … and 3 more\."):
        load_checkpoint(path, model=bigger)
    folder = tmp_path / "state"
    folder.mkdir()
    for name in "abcde":
        (folder / f"{name}.txt").write_text(name)
    with pytest.raises(UserError, match=r"not a checkpoint's \(a\.txt, b\.txt, c\.txt, … and 2 more\)"):
        toolkit.build_accelerator("single").save_state(folder)


@pytest.fixture
def umask():
    """Set this process's umask for the test; the previous one is restored after it."""
    before = os.umask(0o022)
    yield os.umask
    os.umask(before)


def saved_everything(accelerator, out):
    """save_state, save_model and save (safetensors) of a small trained model, under `accelerator`."""
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.backward(model(torch.randn(4, 3)).square().mean())
    optimizer.step()
    accelerator.save_state(out / "state")
    accelerator.save_model(model, out / "model")
    accelerator.save_model(model, out / "shards", max_shard_size=20)  # one shard per tensor
    accelerator.save(accelerator.get_state_dict(model), out / "weights.safetensors", safe_serialization=True)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask-022", "umask-027"])
@pytest.mark.parametrize("engine,checkpoint_format", [("single", "full"), ("single", "sharded"),
                                                      ("accelerate", "full")])
def test_every_file_a_save_writes_has_the_mode_the_umask_gives(engine, checkpoint_format, mask, mode, tmp_path,
                                                                 umask):
    """model.safetensors was 0600 beside 0644 files (safetensors writes through a temporary file created
    0600): teammates on shared storage could read everything of a checkpoint but its weights. Every file of
    save_state (full, sharded, Accelerate's own), save_model, save and `toolkit checkpoint consolidate` honours
    the umask like any other file."""
    import toolkit
    from accelerate.state import AcceleratorState
    from toolkit.checkpoint.consolidate import consolidate

    umask(mask)
    accelerator = toolkit.build_accelerator(engine, checkpoint_format=checkpoint_format)
    try:
        saved_everything(accelerator, tmp_path)
    finally:
        if engine == "accelerate":
            AcceleratorState._reset_state(True)
    if checkpoint_format == "sharded":
        consolidate(tmp_path / "state", tmp_path / "full")
        consolidate(tmp_path / "state", tmp_path / "consolidated.safetensors")
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {"model.safetensors", "manifest.json", "state.json"} <= {p.name for p in files}
    assert any(p.name.startswith("model-00002") for p in files)  # save_model's shards
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(mode)}, modes


def test_keep_leaves_newest_and_latest_points_at_it(tmp_path):
    model = make_model()
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, model=model, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000004"
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000003", "step-00000004"]


def test_resave_at_same_step_replaces_it(tmp_path):
    model = make_model()
    save_checkpoint(tmp_path, 5, model=model)
    with torch.no_grad():
        model[0].weight.fill_(3.0)
    path = save_checkpoint(tmp_path, 5, model=model, state={"epoch": 2})
    target = make_model()
    assert load_checkpoint(tmp_path, model=target) == {"step": 5, "epoch": 2}
    assert torch.all(target[0].weight == 3.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", path.name]


def dead_pid():
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_torn_save_is_ignored_then_cleaned(tmp_path):
    model = make_model()
    save_checkpoint(tmp_path, 1, model=model)
    save_checkpoint(tmp_path, 2, model=model)
    torn = tmp_path / f".tmp-step-00000003-{dead_pid()}"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\x00" * 100)  # killed mid-write: no manifest
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000001", "step-00000002"]
    save_checkpoint(tmp_path, 3, model=model)
    assert not torn.exists()


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "drop_manifest", "drop_file"])
def test_damaged_newest_fails_verify_and_latest_falls_back(tmp_path, capsys, damage):
    model = make_model()
    save_checkpoint(tmp_path, 1, model=model)
    newest = save_checkpoint(tmp_path, 2, model=model)
    weights = newest / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[:-10])
    elif damage == "flip_byte":
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "drop_manifest":
        (newest / "manifest.json").unlink()
    else:
        weights.unlink()
    with pytest.raises(UserError, match=str(newest)):
        verify_checkpoint(newest)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and str(newest) in warnings[0]
    assert load_checkpoint(tmp_path, model=make_model())["step"] == 1


def test_a_pointer_left_behind_by_a_kill_after_publishing_does_not_hide_the_newer_checkpoint(tmp_path):
    """Killed between publishing step 2 and moving `latest` (a peer's collective in between under save_state):
    the resume takes step 2, which is complete, not step 1."""
    model = make_model()
    save_checkpoint(tmp_path, 1, model=model)
    save_checkpoint(tmp_path, 2, model=model)
    (tmp_path / "latest").write_text("step-00000001\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000002"


def test_stale_or_garbage_pointer_falls_back(tmp_path):
    model = make_model()
    save_checkpoint(tmp_path, 1, model=model)
    (tmp_path / "latest").write_text("step-00000009\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    (tmp_path / "latest").write_text("../../etc\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000001"
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(UserError, match="nothing-here"):
        load_checkpoint(tmp_path / "nothing-here")


WRITER_SERVER = """
import os, sys, torch
from toolkit.checkpoint.functional import latest_checkpoint, save_checkpoint

def save_forever(root):
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2500, 2000, bias=False) for _ in range(3)])
    model = model.to_empty(device="cpu")  # 3 x 20 MB without a slow random init
    latest = latest_checkpoint(root)
    step = 0 if latest is None else int(latest.name.split("-")[1]) + 1
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(step)
        save_checkpoint(root, step, model=model, state={"step": step}, keep=2)
        print("saved", os.getpid(), flush=True)
        step += 1

# Each line on stdin forks one writer: a fresh interpreter would spend seconds importing torch.
for _ in sys.stdin:
    pid = os.fork()
    if pid == 0:
        save_forever(sys.argv[1])
    os.waitpid(pid, 0)
    print("dead", flush=True)
"""


def big_model():
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2500, 2000, bias=False) for _ in range(3)])
    return model.to_empty(device="cpu")


def test_sigkill_mid_save_leaves_a_loadable_latest(tmp_path):
    server = subprocess.Popen([sys.executable, "-c", WRITER_SERVER, str(tmp_path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    delays = random.Random(1234)
    target = big_model()
    try:
        for attempt in range(4):
            server.stdin.write("start a writer\n")
            server.stdin.flush()
            word, pid = server.stdout.readline().split()  # one complete save, then kill mid-flight
            time.sleep(delays.uniform(0.0, 0.6))
            os.kill(int(pid), signal.SIGKILL)
            assert "dead\n" in iter(server.stdout.readline, ""), "writer server exited"
            latest = latest_checkpoint(tmp_path)
            assert latest is not None
            verify_checkpoint(latest)
            state = load_checkpoint(latest, model=target)
            assert torch.all(target[2].weight == state["step"])
            leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
            assert all(name.endswith(f"-{pid}") for name in leftovers), leftovers
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("name", ["optimizer.bin", "random_states_0.pkl"])
def test_malicious_pickle_is_refused(tmp_path, name):
    model, optimizer, _ = make_training()
    path = save_checkpoint(tmp_path / "ckpt", 1, model=model, optimizer=optimizer)
    marker = tmp_path / "pwned"
    evil = path / name
    torch.save({"state": {0: CreatesFileOnLoad(marker)}, "param_groups": []}, evil)
    torch.load(evil, weights_only=False)  # proves the payload really runs code when unpickled
    assert marker.exists()
    marker.unlink()
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][name] = {"size": evil.stat().st_size,
                               "sha256": hashlib.sha256(evil.read_bytes()).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    verify_checkpoint(path)  # the hashes match: only weights_only loading stands in the way

    with pytest.raises(UserError, match="Refusing to load"):
        load_checkpoint(path, model=model, optimizer=optimizer)
    assert not marker.exists()


class WarmupConfig:
    steps = 10


class Warmup:  # a callable lr_lambda: LambdaLR saves its __dict__, config object and all
    def __init__(self):
        self.config = WarmupConfig()

    def __call__(self, step):
        return 1.0


def test_state_that_could_not_be_loaded_safely_is_refused_at_save_time(tmp_path):
    model, optimizer, _ = make_training()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, Warmup())
    with pytest.raises(UserError, match="scheduler.bin"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, scheduler=scheduler)
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no pointer, no temp folder


class _Ranks:
    def __init__(self, num_processes):
        self.num_processes, self.printed = num_processes, []

    def print(self, line):
        self.printed.append(line)


def test_resume_position_maps_samples_to_steps():
    """A checkpoint 10 global batches of 128 into epoch 1 resumes at batch 10 of epoch 1, on any world size
    with the same global batch; a position between two steps resumes at the step before, and says so."""
    from toolkit.train.data_position import resume_position

    state = {"step": 49, "epoch": 1, "samples_in_epoch": 10 * 128, "world_size": 2}
    assert resume_position(state, 128, _Ranks(2)) == (49, 1, 10)
    one = _Ranks(1)
    assert resume_position(state, 128, one) == (49, 1, 10) and "2-process checkpoint on 1" in one.printed[0]
    odd = _Ranks(2)
    assert resume_position({**state, "samples_in_epoch": 10 * 128 + 64}, 128, odd) == (49, 1, 10)
    assert "resuming at the step before" in odd.printed[-1]


def test_a_schedule_saved_by_two_processes_goes_on_from_its_count_on_one(tmp_path):
    """An lr schedule registered for checkpointing (as the recipes register theirs), saved 5 optimizer steps in by
    a 2-process run and loaded on 1 process, goes on from step 5: the learning rate is the saved one, not the
    schedule's first. The folder says 2 processes in state.json and its manifest, as a 2-process save_state
    writes it (test_recipe.py resumes a real one: test_ddp_checkpoint_resumes_on_one_process_under_single_and_dp)."""
    import toolkit
    from toolkit.checkpoint.folder import MANIFEST_NAME, seal

    def build():
        torch.manual_seed(3)
        net = torch.nn.Linear(3, 2)
        model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / 10)
        accelerator.register_for_checkpointing(scheduler)
        return model, optimizer, scheduler

    accelerator = toolkit.build_accelerator("single")
    model, optimizer, scheduler = build()
    for _ in range(5):
        accelerator.backward(model(torch.randn(4, 3)).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    folder = Path(accelerator.save_state(tmp_path / "saved"))
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps({**state, "world_size": 2}))
    about = {k: v for k, v in json.loads((folder / MANIFEST_NAME).read_text()).items() if k not in ("format", "files")}
    seal(folder, {**about, "world_size": 2})
    accelerator.end_training()

    accelerator = toolkit.build_accelerator("single")  # as a new process would
    model, optimizer, scheduler = build()
    accelerator.load_state(folder)
    assert scheduler.last_epoch == 5 and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (1 - 5 / 10))
    accelerator.end_training()
