"""What `prepare()` returns is Accelerate's, by name and by meaning, on every engine: each public name of
Accelerate's `AcceleratedOptimizer`, `AcceleratedScheduler` and `DataLoaderShard` (enumerated with `dir()`, so a name
a new Accelerate release adds turns this red) is there, or calling it is one sentence naming the engine that has it.
A schedule-free optimizer's train()/eval() reach it, as in Accelerate's examples/by_feature/schedule_free.py; the
loader's end_of_dataloader, remainder, total_dataset_length, get_sampler and set_sampler mean Accelerate's (at
world 1 against Accelerate's own loader; across 2 ranks in tests/scripts/api_two_ranks.py)."""

import contextlib
import itertools

import pytest
import schedulefree
import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import toolkit
from toolkit.engines.samplers import DatasetOrder, RankShare
from toolkit.errors import UserError

ENGINES = ("single", "dp", "ddp", "fsdp", "accelerate")
# DataLoaderShard's hooks that Accelerate's GradientState calls on its own loaders, not a script's names.
INTERNAL = {"begin", "end", "reset", "adjust_state_dict_for_prefetch"}


def public(cls) -> list[str]:
    return [name for name in dir(cls) if not name.startswith("_") and name not in INTERNAL]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    accelerator = toolkit.build_accelerator(request.param, cpu=True)
    yield accelerator
    accelerator.end_training()


def prepared(accelerator, dataset=TensorDataset(torch.arange(10.0)), batch_size=4, shuffle=True):
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)
    return accelerator.prepare(model, optimizer, scheduler, loader)[1:]


def test_every_public_name_of_accelerates_prepared_objects_is_there(engine):
    optimizer, scheduler, loader = prepared(engine)
    for cls, obj in ((AcceleratedOptimizer, optimizer), (AcceleratedScheduler, scheduler), (DataLoaderShard, loader)):
        missing = [name for name in public(cls) if not hasattr(obj, name)]
        assert not missing, f"{engine.name}: {type(obj).__name__} lacks {missing} of {cls.__name__}"
    if engine.name != "accelerate":  # as in Accelerate, a loader's state is a stateful loader's: one sentence
        for call in (loader.state_dict, lambda: loader.load_state_dict({})):
            with pytest.raises(UserError, match=r"DataLoaderConfiguration\(use_stateful_dataloader=True\)") as refused:
                call()
            assert "\n" not in str(refused.value)


def schedule_free_run(accelerator=None) -> list[float]:
    """Accelerate's schedule_free.py in small: optimizer.train() before each step, optimizer.eval() before each
    evaluation, whose loss is taken at the averaged weights that eval() swaps in. No accelerator: the same loop
    on the bare model and optimizer."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = schedulefree.SGDScheduleFree(model.parameters(), lr=0.3, momentum=0.9, warmup_steps=2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    if accelerator is not None:
        model, optimizer = accelerator.prepare(model, optimizer)
    evaluations = []
    for _ in range(6):
        model.train()
        optimizer.train()
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss) if accelerator is not None else loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.eval()
        optimizer.eval()
        with torch.no_grad():
            evaluations.append(torch.nn.functional.mse_loss(model(x), y).item())
    return evaluations


def test_a_schedule_free_optimizer_evaluates_at_its_averaged_weights_as_without_an_accelerator(engine):
    reference = schedule_free_run()
    assert reference[-1] < reference[0]  # it learned
    # One process, the same float32 operations in the same order: measured bit for bit (difference 0.0) on every
    # engine under the native avx2 kernels and under ATEN_CPU_CAPABILITY=default; rel 1e-6 allows a few ulps.
    assert schedule_free_run(engine) == pytest.approx(reference, rel=1e-6)


def epoch(loader) -> list[tuple[list[float], bool, int]]:
    return [(batch.tolist(), loader.end_of_dataloader, loader.remainder) for (batch,) in loader]


def test_the_loaders_epoch_state_means_accelerates_at_world_1(engine):
    """10 samples in batches of 4: the last batch holds 2 (`remainder`), and `end_of_dataloader` is set while it is
    handed out and stays set after the epoch, as on Accelerate's own loader (the reference, unshuffled)."""
    _, _, loader = prepared(engine, shuffle=False)
    ours = epoch(loader)
    assert (loader.total_dataset_length, loader.end_of_dataloader, loader.total_batch_size) == (10, True, 4)
    assert [(end, remainder) for _, end, remainder in ours] == [(False, 2), (False, 2), (True, 2)]
    assert [batch for batch, _, _ in ours] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0], [8.0, 9.0]]
    assert len(loader.get_sampler()) == 10  # the whole dataset's order, not one rank's share


def test_accelerates_own_loader_means_what_the_test_above_asserts():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4))
    assert loader.remainder == -1 and not loader.end_of_dataloader  # before the epoch
    assert [(end, remainder) for _, end, remainder in epoch(loader)] == [(False, 2), (False, 2), (True, 2)]
    assert (loader.total_dataset_length, loader.end_of_dataloader, loader.total_batch_size) == (10, True, 4)
    assert len(loader.get_sampler()) == 10


def test_a_sampler_set_on_the_loader_orders_the_next_epoch(engine):
    _, _, loader = prepared(engine, shuffle=False)
    loader.set_sampler(list(reversed(range(10))))  # any sized iterable of indices, as DataLoader takes
    assert [batch for batch, _, _ in epoch(loader)] == [[9.0, 8.0, 7.0, 6.0], [5.0, 4.0, 3.0, 2.0], [1.0, 0.0]]


@pytest.mark.parametrize("length,world", [(9, 2), (10, 4), (3, 4), (1, 2), (12, 3)])
def test_each_ranks_share_of_the_order_is_distributed_samplers(length, world):
    """The split (and its padding with repeats) is torch's DistributedSampler's, for every rank, epoch and seed:
    resumes and checkpoints from before the order became a sampler of its own keep their data order."""
    dataset = list(range(length))
    for shuffle in (True, False):
        for rank in range(world):
            ours = RankShare(DatasetOrder(length, shuffle=shuffle, seed=17), world, rank)
            torchs = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=17)
            for e in (0, 3):
                ours.set_epoch(e)
                torchs.set_epoch(e)
                assert list(ours) == list(torchs) and len(ours) == len(torchs), (shuffle, rank, e)


def test_an_fp16_overflow_is_a_skipped_step_that_the_schedule_skips_and_the_run_counts(engine):
    """What fp16 does on an inf gradient, reached on CPU: a CPU GradScaler stands in for CUDA's (fp16 itself needs
    CUDA here) and the second step's loss is multiplied by inf. That step is skipped on every engine: the weights
    stay, `step_was_skipped` and `optimizer_step_was_skipped` say so, the prepared scheduler does not tick, the
    engine counts one skipped step and the scaler halves its scale; the next step trains again."""
    holder = engine.accelerator if engine.name == "accelerate" else engine  # where prepare and backward read it
    holder.scaler = scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    try:
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
        model, optimizer, scheduler = engine.prepare(model, optimizer, scheduler)
        skipped_before, seen = engine.skipped_steps, []
        for factor in (1.0, float("inf"), 1.0):
            before = {name: tensor.clone() for name, tensor in engine.get_state_dict(model).items()}
            engine.backward(model(torch.ones(4, 2)).sum() * factor)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            moved = any(not torch.equal(before[name], tensor) for name, tensor in engine.get_state_dict(model).items())
            seen.append((moved, optimizer.step_was_skipped, engine.optimizer_step_was_skipped,
                         round(scheduler.get_last_lr()[0], 6), scaler.get_scale()))
    finally:
        holder.scaler = None
    assert seen == [(True, False, False, 0.05, 2.0 ** 10),
                    (False, True, True, 0.05, 2.0 ** 9),  # skipped: the lr stays, the scale backs off
                    (True, False, False, 0.033333, 2.0 ** 9)], seen
    assert engine.skipped_steps - skipped_before == 1


@contextlib.contextmanager
def stateful_loaders(engine):
    """DataLoaderConfiguration(use_stateful_dataloader=True) for the loaders prepared inside (the module's engines
    are shared, so the setting is switched on where prepare reads it and off again)."""
    config = engine.accelerator.dataloader_config if engine.name == "accelerate" else DataLoaderConfiguration()
    config.use_stateful_dataloader = True
    if engine.name != "accelerate":
        engine.dataloader_config = config
    try:
        yield
    finally:
        config.use_stateful_dataloader = False
        if engine.name != "accelerate":
            engine.dataloader_config = None


def batches(iterable, count=None) -> list[list[float]]:
    return [batch.tolist() for (batch,) in itertools.islice(iterable, count)]


def test_a_stateful_loaders_state_resumes_its_epoch_where_it_stopped(engine, tmp_path):
    """Accelerate's stateful loaders, on every engine: state_dict() two batches into an epoch; a new loader given
    it by load_state_dict, and the same loader after load_state of a save_state made there, go on with the third
    batch of that epoch, as the uninterrupted epoch does (shuffled, 10 samples in batches of 2)."""
    engine.set_seed(3)
    with stateful_loaders(engine):  # three loaders of one seed: one epoch's order
        reference, loader, fresh = (engine.prepare(DataLoader(TensorDataset(torch.arange(10.0)), batch_size=2,
                                                              shuffle=True)) for _ in range(3))
    uninterrupted = batches(reference)
    iterator = iter(loader)
    assert batches(iterator, 2) == uninterrupted[:2]
    state = loader.state_dict()
    engine.save_state(tmp_path / "state")
    assert batches(iterator) == uninterrupted[2:]  # the loader runs on; then a crash, and each resumes from there
    fresh.load_state_dict(state)
    assert batches(fresh) == uninterrupted[2:]
    engine.load_state(tmp_path / "state")
    assert batches(loader) == uninterrupted[2:]  # no skip_first_batches: the loader knows where it was


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "accelerate"], indirect=True)  # Accelerate's own
def test_a_plain_engines_loader_state_carries_its_epoch_and_resumes_on_another_world(engine):
    """Beyond Accelerate (whose state holds no epoch, so a new loader resumes the first epoch's order): the state
    names the epoch and the samples handed out, so it resumes the right epoch, and a world whose global batches
    tile those samples resumes it too. Shown at world 1 (global batch 4) by a state as 2 ranks of batch 4 save it
    one step in: 8 samples, two of this world's batches."""
    engine.set_seed(3)
    with stateful_loaders(engine):
        loader = engine.prepare(DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4, shuffle=True))
        fresh = engine.prepare(DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4, shuffle=True))
    first, second = batches(loader), batches(loader)
    assert first != second  # two epochs, two orders
    fresh.load_state_dict({"epoch": 1, "batches": 1, "samples": 8})  # 2 ranks x batch 4, one step into epoch 1
    assert batches(fresh) == second[2:]
    with pytest.raises(UserError, match="cannot resume exactly") as refused:
        fresh.load_state_dict({"epoch": 1, "batches": 1, "samples": 6})  # 3 ranks x batch 2: half a batch of 4
    assert "\n" not in str(refused.value)
