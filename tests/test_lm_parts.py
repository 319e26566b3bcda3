"""The character-level LM's parts, in one process: the shipped text and its vocabulary (toolkit/data/text.py),
the window loader's world-size-independent global batch, mid-epoch resume and eval shards, and the GPT
(toolkit/models/gpt.py): shapes, causality, the tied head the fsdp engine keeps whole, and a loss that falls."""

import pytest
import torch
import torch.nn.functional as F

from toolkit.data.text import GENESIS, CharText, WindowLoader, load_text
from toolkit.engines.fsdp import replicated_parameters
from toolkit.engines.units import shard_units
from toolkit.errors import UserError
from toolkit.models.gpt import Block, build_gpt

BLOCK = 16  # short windows keep the test fast; the loader's logic does not depend on the length


@pytest.fixture(autouse=True)
def one_thread():
    # As in test_data_models.py: tensors this small gain nothing from a second thread, and when other tests'
    # processes share the two cores, two spinning intra-op threads made this file 25x slower (8 min, not 18 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text():
    return load_text()


def test_the_shipped_text_round_trips_through_its_sorted_vocabulary(text):
    raw = GENESIS.read_text(encoding="utf-8")
    assert text.decode(text.tokens) == raw and len(raw) == 196_818
    assert text.chars == "".join(sorted(set(raw))) and text.vocab_size == 60
    assert text.tokens.dtype == torch.uint8
    assert len(text.val) == len(raw) // 10 and text.decode(text.train) + text.decode(text.val) == raw
    assert raw.startswith("In the beginning God created the heaven and the earth.\n")
    with pytest.raises(UserError, match="not in the 60-character vocabulary"):
        text.encode("naïve")


def merged_steps(text, world, accumulation, micro, seed=7, epoch=2):
    """Per optimizer step: the sequences all ranks saw in its micro-steps, in the single loader's order
    (micro-step by micro-step, rank r's rows at positions r::world of each)."""
    ranks = [WindowLoader(text.train, BLOCK, micro, rank=r, world_size=world, seed=seed) for r in range(world)]
    for loader in ranks:
        loader.set_epoch(epoch)
    steps, micro_steps = [], list(zip(*ranks))
    for start in range(0, len(micro_steps) - accumulation + 1, accumulation):
        parts = []
        for per_rank in micro_steps[start:start + accumulation]:
            x = torch.empty(world * micro, BLOCK, dtype=torch.int64)
            y = torch.empty_like(x)
            for r, (xr, yr) in enumerate(per_rank):
                x[r::world], y[r::world] = xr, yr
            parts.append((x, y))
        steps.append(tuple(torch.cat(t) for t in zip(*parts)))
    return steps


@pytest.mark.parametrize("world, accumulation", [(2, 2), (4, 1), (3, 2)])
def test_every_optimizer_step_sees_the_same_sequences_at_any_world_size(text, world, accumulation):
    global_batch = 48
    single = WindowLoader(text.train, BLOCK, global_batch, seed=7)
    single.set_epoch(2)
    expected = list(single)
    got = merged_steps(text, world, accumulation, global_batch // (world * accumulation))
    assert len(got) == len(expected) == (len(text.train) // BLOCK - 1) // global_batch
    assert all(torch.equal(x, ex) and torch.equal(y, ey) for (x, y), (ex, ey) in zip(got, expected))


def test_windows_are_text_with_y_one_token_on(text):
    loader = WindowLoader(text.train, BLOCK, 8, seed=5)
    loader.set_epoch(3)
    x, y = next(iter(loader))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8, BLOCK)
    assert torch.equal(x[:, 1:], y[:, :-1])
    train_text = text.decode(text.train)
    assert all(text.decode(row) + text.decode(last) in train_text for row, last in zip(x, y[:, -1]))


def test_an_epoch_is_disjoint_windows_at_one_offset_drawn_from_seed_and_epoch():
    positions = torch.arange(1000)  # token i is i: a window shows where it starts
    loader = WindowLoader(positions, BLOCK, 8, seed=5, drop_last=False)
    epochs = []
    for epoch in range(6):
        loader.set_epoch(epoch)
        x, y = (torch.cat(t) for t in zip(*loader))
        starts = x[:, 0]
        assert torch.equal(x, starts[:, None] + torch.arange(BLOCK)) and torch.equal(y, x + 1)
        assert len(set(starts.tolist())) == len(starts) == 1000 // BLOCK - 1 and y.max() < 1000  # all, no repeats
        assert set((starts % BLOCK).tolist()) == {loader.offset(epoch)}  # adjacent windows: none overlaps
        assert not torch.equal(starts, starts.sort().values)  # shuffled
        epochs.append(starts)
    assert len({loader.offset(epoch) for epoch in range(6)}) > 1  # epochs cut the text at different places
    again = WindowLoader(positions, BLOCK, 8, seed=5, drop_last=False)
    again.set_epoch(5)
    assert torch.equal(torch.cat([x for x, _ in again])[:, 0], epochs[5])


def test_start_batch_resumes_with_the_tail_of_the_epoch(text):
    loader = WindowLoader(text.train, BLOCK, 8, rank=1, world_size=2, seed=3)
    loader.set_epoch(1)
    full = list(loader)
    loader.set_epoch(1, start_batch=5)
    tail = list(loader)
    assert len(tail) == len(full) - 5
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(tail, full[5:]))
    assert len(list(loader)) == len(full)  # start_batch applies to one iteration only
    assert loader.resumes_mid_epoch


@pytest.mark.parametrize("world_size", [2, 3])
def test_eval_shards_are_disjoint_and_cover_every_window_once(text, world_size):
    count = (len(text.val) - 1) // BLOCK
    windows = text.val[:count * BLOCK + 1].long()
    ranks = [WindowLoader(text.val, BLOCK, 5, rank=r, world_size=world_size, train=False) for r in range(world_size)]
    for r, loader in enumerate(ranks):
        x, y = (torch.cat(t) for t in zip(*loader))
        assert torch.equal(x, windows[:-1].view(count, BLOCK)[r::world_size])
        assert torch.equal(y, windows[1:].view(count, BLOCK)[r::world_size]) and len(x) == loader.num_samples
    assert sum(loader.num_samples for loader in ranks) == ranks[0].samples_per_epoch == count


def test_a_text_too_short_for_a_window_is_a_user_error():
    short = CharText("abcab")
    with pytest.raises(UserError, match="hold no training window"):
        WindowLoader(short.tokens, 8, 1)


@pytest.fixture(scope="module")
def gpt(text):
    torch.manual_seed(3)
    return build_gpt("gpt-tiny", text.vocab_size)


def test_gpt_maps_tokens_to_logits_and_ties_its_head(gpt, text):
    idx = torch.randint(0, text.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    assert gpt(idx).shape == (3, 40, text.vocab_size)
    assert gpt.head.weight is gpt.tok_emb.weight
    units = shard_units(gpt)
    assert sum(isinstance(u, Block) for u in units) == gpt.cfg.n_layer == 2  # each block sharded on its own
    assert list(replicated_parameters(gpt, units)) == ["tok_emb.weight"]  # the tied weight stays whole
    with pytest.raises(ValueError, match="longer than block_size 64"):
        gpt(torch.zeros(1, 65, dtype=torch.int64))


def test_logits_at_t_do_not_depend_on_later_tokens(gpt, text):
    idx = torch.randint(0, text.vocab_size, (2, 64), generator=torch.Generator().manual_seed(2))
    changed = idx.clone()
    changed[:, 31] = (idx[:, 31] + 1) % text.vocab_size
    with torch.no_grad():
        before, after = gpt(idx), gpt(changed)
    assert torch.allclose(before[:, :31], after[:, :31], rtol=0, atol=1e-6)
    assert (before[:, 31:] - after[:, 31:]).abs().amax(-1).min() > 1e-4  # and every later position sees it


def test_a_few_adamw_steps_on_one_batch_lower_the_loss(text):
    torch.manual_seed(4)
    model = build_gpt("gpt-tiny", text.vocab_size)
    loader = WindowLoader(text.train, 64, 16, seed=4)
    x, y = next(iter(loader))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(60.0)).item()) < 0.1  # uniform at initialisation
    assert losses[-1] < losses[0] - 1.0, losses
