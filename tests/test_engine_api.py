"""Every engine offers Accelerate's public Accelerator API (the `AcceleratorAPI` protocol in engines/api.py),
takes every keyword a script passes to Accelerate's own method, refuses what it cannot honour in one sentence
naming the engine to use, and means what Accelerate means: checked in one process at world 1 for all five
engines, and across 2 real ranks (tests/scripts/api_two_ranks.py) for what only shows with a peer.
"""

import inspect
import json
import re

import pytest
import torch
from accelerate import Accelerator
from conftest import PY, SCRIPTS, TORCHRUN, read_json, run
from torch.utils.data import DataLoader, TensorDataset

import toolkit
from toolkit.engines.api import AcceleratorAPI
from toolkit.errors import UserError
from toolkit.launch.launcher import free_port

ENGINES = ("single", "dp", "ddp", "fsdp", "accelerate")
MEMBERS = [name for name in AcceleratorAPI.__dict__.get("__annotations__", {})] + [
    name for name, value in vars(AcceleratorAPI).items() if callable(value) and not name.startswith("_")]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    accelerator = toolkit.build_accelerator(request.param, cpu=True)
    yield accelerator
    accelerator.end_training()


def test_every_engine_satisfies_the_protocol(engine):
    assert isinstance(engine, AcceleratorAPI)
    missing = [name for name in MEMBERS if not hasattr(engine, name)]
    assert not missing, f"{engine.name} lacks {missing}"


def test_no_accelerator_name_is_a_bare_attribute_error(engine):
    """Every public name of Accelerate's Accelerator class (and its state objects) is there, or reading it is
    one sentence naming the engine that has it."""
    names = [n for n in dir(Accelerator) if not n.startswith("_")] + ["state", "gradient_state"]
    for name in names:
        try:
            getattr(engine, name)
        except UserError as error:
            assert "use the accelerate engine" in str(error) and "\n" not in str(error)
        except AttributeError as error:
            pytest.fail(f"{engine.name}: {name}: {error}")
        except Exception:  # noqa: BLE001 -- a real Accelerator's own property refusing (context parallelism)
            assert engine.name == "accelerate", name


def test_every_method_takes_the_keywords_accelerate_takes(engine):
    for name in MEMBERS:
        reference = getattr(Accelerator, name, None)
        if not callable(reference) or isinstance(reference, property):
            continue
        ours = inspect.signature(getattr(engine, name)).parameters
        if any(p.kind is p.VAR_KEYWORD for p in ours.values()):
            continue
        theirs = [p for p in inspect.signature(reference).parameters if p != "self"
                  and inspect.signature(reference).parameters[p].kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                                              inspect.Parameter.VAR_KEYWORD)]
        assert set(theirs) <= set(ours), f"{engine.name}.{name} lacks {set(theirs) - set(ours)}"


def test_world_of_one_meanings(engine, tmp_path, capsys):
    assert (engine.num_processes, engine.process_index, engine.is_last_process) == (1, 0, True)
    assert engine.distributed_type in ("NO", "MULTI_CPU", "FSDP")
    with engine.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    assert torch.equal(engine.pad_across_processes(torch.ones(2, 3), dim=1), torch.ones(2, 3))
    assert engine.on_main_process(lambda: 7)() == 7 and engine.on_last_process(lambda: 8)() == 8
    assert engine.check_trigger() is False
    engine.set_trigger()
    assert engine.check_trigger() is True and engine.check_trigger() is False  # reset once read
    with engine.local_main_process_first():
        pass
    assert engine.optimizer_step_was_skipped is False


def test_save_model_writes_full_weights_and_shards_above_the_limit(engine, tmp_path):
    model = engine.prepare(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)))
    engine.save_model(model, tmp_path / "whole")
    engine.save_model(model, tmp_path / "shards", max_shard_size="10KB")
    import safetensors.torch

    whole = safetensors.torch.load_file(tmp_path / "whole" / "model.safetensors")
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    shards = {}
    for file in set(index["weight_map"].values()):
        shards.update(safetensors.torch.load_file(tmp_path / "shards" / file))
    expected = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in engine.unwrap_model(model).state_dict().items()}
    assert whole.keys() == shards.keys() == expected.keys() and len(set(index["weight_map"].values())) > 1
    assert all(torch.equal(whole[k], expected[k].cpu()) and torch.equal(shards[k], whole[k]) for k in whole)
    engine.free_memory()


def test_profile_writes_a_chrome_trace(engine, tmp_path):
    from accelerate.utils import ProfileKwargs

    with engine.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path))) as profiler:
        torch.ones(64, 64) @ torch.ones(64, 64)
    trace = json.loads((tmp_path / "profile_0.json").read_text())
    assert any("mm" in event.get("name", "") for event in trace["traceEvents"])
    assert "aten::mm" in profiler.key_averages().table()


def test_free_memory_forgets_what_was_prepared(engine):
    model = engine.prepare(torch.nn.Linear(2, 2))
    released = engine.free_memory(model)
    assert released == [None] and engine._models == [] and engine.step == 0


FREEZE_CHILD = """
import atexit, gc, os, sys
import torch
import toolkit
before, at_exit = sys.argv[1:3]
atexit.register(lambda: print(f"exit: finalized={os.path.exists(at_exit)} frozen={gc.get_freeze_count()}"))
gc.disable()  # the cycles below are garbage that only the toolkit's collections find
class Cycle:
    def __init__(self, path):
        self.path, self.me = path, self
    def __del__(self):
        open(self.path, "w").close()
Cycle(before)
kept = [torch.nn.Linear(2, 2)]
toolkit.build_accelerator("single")
print(f"built: finalized={os.path.exists(before)} frozen={gc.get_freeze_count()} "
      f"kept_frozen={all(tracked is not kept for tracked in gc.get_objects())}")  # frozen: in no generation
Cycle(at_exit)
"""


def test_a_process_with_an_engine_freezes_what_it_loaded_and_collects_once_at_exit(tmp_path):
    """build_accelerator collects the garbage there is (a dropped cycle's finalizer runs) and freezes what is
    alive (torch's objects, the script's), which later collections skip. At exit its handler (run before the
    script's own, registered earlier) runs the finalizer of a cycle dropped since, then freezes the rest, which
    the interpreter's collections at shutdown then skip."""
    proc = run([PY, "-c", FREEZE_CHILD, tmp_path / "before", tmp_path / "at_exit"])
    built, at_exit = proc.stdout.splitlines()
    finalized, frozen, kept = re.fullmatch(r"built: finalized=(\w+) frozen=(\d+) kept_frozen=(\w+)", built).groups()
    assert finalized == "True" and kept == "True", built
    assert int(frozen) > 100_000, built  # torch alone holds about 180,000 (measured)
    finalized, frozen_at_exit = re.fullmatch(r"exit: finalized=(\w+) frozen=(\d+)", at_exit).groups()
    assert finalized == "True" and int(frozen_at_exit) > int(frozen), at_exit


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_settings_an_engine_cannot_honour_are_refused_in_one_sentence(name):
    from accelerate.utils import DeepSpeedPlugin, TERecipeKwargs

    with pytest.raises(UserError, match=f"the {name} engine cannot honour Accelerator\\(deepspeed_plugin=...\\); use "
                                        "the accelerate engine") as caught:
        toolkit.build_accelerator(name, cpu=True, deepspeed_plugin=DeepSpeedPlugin.__new__(DeepSpeedPlugin))
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="does not take TERecipeKwargs in kwargs_handlers.*accelerate engine"):
        toolkit.build_accelerator(name, cpu=True, kwargs_handlers=[TERecipeKwargs.__new__(TERecipeKwargs)])
    with pytest.raises(TypeError, match="unexpected keyword argument"):  # a typo is not a setting
        toolkit.build_accelerator(name, cpu=True, gradient_acumulation_steps=2)


def test_skip_first_batches_resumes_the_same_epoch_mid_way():
    accelerator = toolkit.build_accelerator("single", cpu=True)
    accelerator.set_seed(5)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=3, shuffle=True))
    first = [x.tolist() for (x,) in loader]  # epoch 0
    second = [x.tolist() for (x,) in loader]  # epoch 1: another order
    assert first != second
    loader.set_epoch(1)
    assert [x.tolist() for (x,) in accelerator.skip_first_batches(loader, 4)] == second[4:]
    assert loader.epoch == 2  # the skipping view advanced the same epoch counter


# -- 2 ranks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    run(TORCHRUN + ["--master_port", free_port(), SCRIPTS / "api_two_ranks.py", out], timeout=240)
    return {rank: read_json(out / f"rank{rank}.json") for rank in (0, 1)}


def test_split_between_processes_gives_contiguous_shares_padded_on_request(two_ranks):
    assert two_ranks[0]["split"] == [0, 1, 2] and two_ranks[1]["split"] == [3, 4]
    assert two_ranks[1]["split_padded"] == [3, 4, 4] and two_ranks[1]["split_tensor"] == [3, 4, 4]
    assert two_ranks[0]["split_dict"] == {"a": [0, 1, 2], "b": ["x", "y", "z"]}


def test_pad_across_processes_pads_to_the_longest_rank(two_ranks):
    assert two_ranks[0]["padded"] == [[1, 1, 0], [1, 1, 0]] and two_ranks[1]["padded"] == [[2, 2, 2], [2, 2, 2]]
    assert two_ranks[0]["padded_first"] == [[0, 1, 1], [0, 1, 1]]


def test_a_trigger_on_one_rank_is_seen_on_every_rank(two_ranks):
    assert all(two_ranks[r]["trigger"] == [False, True, False] for r in (0, 1))


def test_decorated_functions_run_only_where_asked(two_ranks):
    assert two_ranks[0]["ran"] == ["main", "local_main"] and two_ranks[1]["ran"] == ["last", "process 1"]


def test_gather_for_metrics_drops_the_samplers_repeats(two_ranks):
    assert all(sorted(two_ranks[r]["eval"]) == list(range(9)) for r in (0, 1))


def test_a_prepared_loaders_epoch_state_and_sampler_mean_accelerates_on_two_ranks(two_ranks):
    """Accelerate's DataLoaderShard names with a peer: end_of_dataloader on each rank's last batch, remainder the
    samples of the last global batch (9 % 4), the dataset's length and its whole order; a sampler set on the
    loader orders the whole dataset and each rank still takes its share (every sample gathered once)."""
    for rank in (0, 1):
        assert [end for _, end, _ in two_ranks[rank]["loader_epoch"]] == [False, False, True]
        assert {remainder for _, _, remainder in two_ranks[rank]["loader_epoch"]} == {1}
        assert two_ranks[rank]["loader_sizes"] == [9, 9, 4]
        assert sorted(two_ranks[rank]["set_sampler_eval"]) == list(range(9))
    assert two_ranks[0]["set_sampler_mine"] == [[8, 6], [4, 2], [0]]
    assert two_ranks[1]["set_sampler_mine"] == [[7, 5], [3, 1], [8]]  # the order padded with its own start
    assert two_ranks[0]["gathered_objects"] == ["r0", "r1"]


def test_main_process_first_orders_the_ranks(two_ranks):
    assert two_ranks[0]["order"] < two_ranks[1]["order"]


def test_save_state_from_two_ranks_holds_each_ranks_rng(two_ranks):
    assert two_ranks[0]["rng_files"] == ["random_states_0.pkl", "random_states_1.pkl"]
    assert all(two_ranks[r]["rng_restored"] for r in (0, 1))


class Counter:
    """A registered object: save_state keeps its state_dict in custom_checkpoint_0.pkl."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_save_state_restores_everything_and_load_state_verifies(engine, tmp_path):
    torch.manual_seed(4)
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = engine.prepare(net, optimizer, scheduler)
    counter = Counter()
    engine.register_for_checkpointing(counter)
    def train(steps):
        for _ in range(steps):
            engine.backward(model(torch.randn(4, 3, device=engine.device)).square().mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()

    train(3)
    counter.count = 3
    engine.save_state(tmp_path / "state")
    saved = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
    expected_rand, lr = torch.rand(2), optimizer.param_groups[0]["lr"]
    train(2)  # move everything on, then come back
    counter.count = 99
    engine.load_state(tmp_path / "state")
    assert all(torch.equal(v, saved[k]) for k, v in engine.get_state_dict(model).items())
    assert optimizer.param_groups[0]["lr"] == lr and scheduler.state_dict()["last_epoch"] == 3 * engine.num_processes
    assert int(optimizer.state_dict()["state"][0]["step"]) == 3 and counter.count == 3
    assert torch.equal(torch.rand(2), expected_rand)
    (tmp_path / "state" / "optimizer.bin").write_bytes(b"torn")
    with pytest.raises(UserError, match="optimizer.bin has 4 bytes"):
        engine.load_state(tmp_path / "state")
    (tmp_path / "state" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"holds files that are not a checkpoint's \(notes.txt\)"):
        engine.save_state(tmp_path / "state")
    assert (tmp_path / "state" / "notes.txt").read_text() == "mine"
    engine.free_memory()
    engine._custom_objects.clear()


def test_accelerates_local_sgd_averages_the_ranks_every_few_steps(two_ranks):
    assert two_ranks[0]["local_sgd_in_step"] == [False, True, False]


class Position(Counter):
    """A registered object with state_json(): save_state merges its dict into state.json, its keys winning."""

    def state_json(self):
        return {"step": 1000 + self.count, "epoch": 2, "config": {"model": "net"}}


def test_state_json_holds_what_registered_objects_add(engine, tmp_path):
    engine.prepare(torch.nn.Linear(3, 2))
    counter, position = Counter(), Position()
    counter.count, position.count = 5, 7
    engine.register_for_checkpointing(counter, position)
    engine.save_state(tmp_path / "state")
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert (state["step"], state["epoch"], state["config"]) == (1007, 2, {"model": "net"})  # over the engine's step
    assert (state["engine"], state["world_size"]) == (engine.name, 1)
    assert torch.load(tmp_path / "state" / "custom_checkpoint_1.pkl", weights_only=True) == {"count": 7}
    position.count = 0
    engine.load_state(tmp_path / "state")
    assert (counter.count, position.count) == (5, 7)
    engine.free_memory()
    engine._custom_objects.clear()


def test_a_checkpoints_step_counts_optimizer_steps_and_micro_step_is_accumulates_counter(engine, tmp_path):
    """state.json's and manifest.json's `step` is the optimizer steps taken: two optimizers stepping once per
    batch count once, and the count goes on over epochs, where `micro_step` (Accelerate's `step`) starts again
    at each epoch's end. load_state restores the count; a save after one more step says one more."""
    engine.free_memory()
    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizers = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    loader = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)  # 4 batches on 1 process
    first, second, *optimizers, loader = engine.prepare(first, second, *optimizers, loader)

    def train(batches):
        for (inputs,) in batches:
            with engine.accumulate(first, second):
                engine.backward(first(inputs).sum() + second(inputs).sum())
                for optimizer in optimizers:
                    optimizer.step()
                    optimizer.zero_grad()

    train(loader), train(list(loader)[:3])  # an epoch to its end, then 3 batches of the next
    engine.save_state(tmp_path / "state")
    state, manifest = read_json(tmp_path / "state" / "state.json"), read_json(tmp_path / "state" / "manifest.json")
    assert (state["step"], state["micro_step"], manifest["step"]) == (7, engine.step, 7) and engine.step < 7
    engine.optimizer_steps = 0
    engine.load_state(tmp_path / "state")
    assert engine.optimizer_steps == 7
    train(list(loader)[:1])
    engine.save_state(tmp_path / "again")
    assert read_json(tmp_path / "again" / "manifest.json")["step"] == read_json(tmp_path / "again" / "state.json")["step"] == 8
    engine.free_memory()
    assert engine.optimizer_steps == 0


def test_sharded_save_state_round_trips_on_every_engine(engine, tmp_path):
    """checkpoint_format "sharded" at world 1: DCP's files in place of model.safetensors and optimizer.bin, and
    load_state restores weights, optimizer, scheduler, registered objects and RNG as the full format does."""
    torch.manual_seed(4)
    net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = engine.prepare(net, optimizer, scheduler)
    position = Position()
    engine.register_for_checkpointing(position)

    def train(steps):
        for _ in range(steps):
            engine.backward(model(torch.randn(4, 3, device=engine.device)).square().mean())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            position.count += 1

    engine.checkpoint_format = "sharded"
    try:
        train(3)
        engine.save_state(tmp_path / "state")
        saved = {k: v.clone() for k, v in engine.get_state_dict(model).items()}
        moments = {i: s["exp_avg"].clone() for i, s in optimizer.state_dict()["state"].items()}
        expected_rand, lr = torch.rand(2), optimizer.param_groups[0]["lr"]
        train(2)
        engine.load_state(tmp_path / "state")
    finally:
        engine.checkpoint_format = "full"
    manifest = json.loads((tmp_path / "state" / "manifest.json").read_text())
    assert (manifest["checkpoint_format"], manifest["world_size"]) == ("sharded", 1)
    assert {".metadata", "__0_0.distcp", "custom_checkpoint_0.pkl", "scheduler.bin"} <= manifest["files"].keys()
    assert not {"model.safetensors", "optimizer.bin"} & manifest["files"].keys()
    assert json.loads((tmp_path / "state" / "state.json").read_text())["step"] == 1003
    assert all(torch.equal(v, saved[k]) for k, v in engine.get_state_dict(model).items())
    state = optimizer.state_dict()["state"]
    assert all(torch.equal(state[i]["exp_avg"], m) for i, m in moments.items()) and int(state[0]["step"]) == 3
    assert optimizer.param_groups[0]["lr"] == lr and position.count == 3
    assert torch.equal(torch.rand(2), expected_rand)
    engine.free_memory()
    engine._custom_objects.clear()


@pytest.mark.parametrize("name", ["fsdp", "accelerate"])
def test_sharded_save_state_from_two_ranks_loads_in_one_process(name, tmp_path):
    """2 ranks save_state sharded (each its own shards: under fsdp each holds half of every tensor); one process
    under another engine load_states the folder and holds the weights and optimizer state the ranks trained. The
    replicated values a rank keeps apart, BatchNorm's running statistics, are rank 0's, as a full save's are."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sharded_save_state", SCRIPTS / "sharded_save_state.py")
    sharded_save_state = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sharded_save_state)  # its build(): the same model, optimizer and position
    run(TORCHRUN + ["--master_port", free_port(), SCRIPTS / "sharded_save_state.py", name, tmp_path], timeout=240)
    folder, expected = tmp_path / "state", torch.load(tmp_path / "expected.pt", weights_only=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["checkpoint_format"], manifest["world_size"]) == ("sharded", 2)
    assert {".metadata", "__0_0.distcp", "random_states_0.pkl", "random_states_1.pkl"} <= manifest["files"].keys()
    assert not {"model.safetensors", "optimizer.bin"} & manifest["files"].keys()
    if name == "fsdp":
        assert "__1_0.distcp" in manifest["files"]
    assert json.loads((folder / "state.json").read_text())["step"] == 3  # the registered position's, not the engine's
    accelerator = toolkit.build_accelerator("single", cpu=True)
    model, optimizer, scheduler, position = sharded_save_state.build(accelerator)
    accelerator.load_state(folder)
    weights = accelerator.get_state_dict(model)
    assert weights.keys() == expected["weights"].keys()
    assert all(torch.equal(weights[k], expected["weights"][k]) for k in weights)
    rank0, rank1 = expected["running_means"]
    assert not torch.allclose(rank0, rank1) and torch.equal(weights["1.running_mean"], rank0)
    state = optimizer.state_dict()
    assert state["param_groups"] == expected["optimizer"]["param_groups"]
    assert all(torch.equal(state["state"][i][key], saved[key]) for i, saved in expected["optimizer"]["state"].items()
               for key in ("step", "exp_avg", "exp_avg_sq"))
    assert scheduler.state_dict() == expected["scheduler"] and position.step == 3
    accelerator.end_training()
