"""Character-level text for next-token training. `CharText` holds a text's sorted character vocabulary and its
tokens, split into a training part and the last 10% for validation; `load_text` reads a UTF-8 file into one, by
default the Book of Genesis shipped in toolkit/data/texts/ (README.md there says where it comes from).
`WindowLoader` batches (x, y) int64 windows of block_size tokens, y being x shifted by one token. The windows
are ordered and sharded by a MemoryLoader that carries their indices as its labels, so they keep its guarantees
without a second copy of its logic: each optimizer step sees the same sequences whatever the world size and
accumulation, the order is a function of (seed, epoch) alone, `set_epoch(epoch, start_batch)` resumes
mid-epoch, and evaluation shards (train=False) are disjoint and cover every window once.
"""

from __future__ import annotations

from pathlib import Path

import torch

from toolkit.data.memory import MemoryLoader, mix_seed
from toolkit.config import listing
from toolkit.errors import UserError

GENESIS = Path(__file__).with_name("texts") / "genesis.txt"
VAL_FRACTION = 0.1  # the last 10% of the text, so validation is text the model never trained on
# MemoryLoader takes uint8 N x 3 x H x W images and crops 32 x 32 windows of them: its images here are one zero
# broadcast to that shape (no memory per window), and what it yields for them is dropped (measured: 0.4 ms of CPU
# per batch of 32, 1-2% of a gpt-tiny training step); an index plan shared with MemoryLoader would save it.
_PLACEHOLDER_SHAPE = (3, 32, 32)
_OFFSET_STREAM = 1  # mixed into (seed, epoch) so the window offset is drawn apart from MemoryLoader's shuffle


class CharText:
    """A text as tokens: `chars` is its vocabulary (every distinct character, sorted), token i is chars[i];
    `tokens` the whole text, `train` its first 90% and `val` the rest. Tokens are uint8 while the vocabulary
    fits (int32 beyond), so a text costs one byte a character in memory."""

    def __init__(self, text: str, name: str = "text"):
        if len(text) < 2:
            raise UserError(f"{name} holds {len(text)} characters; next-token training needs a longer text.")
        self.name = name
        self.chars = "".join(sorted(set(text)))
        self._index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = self.encode(text)
        split = len(text) - int(len(text) * VAL_FRACTION)
        self.train, self.val = self.tokens[:split], self.tokens[split:]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """The tokens of `text`, one per character; every character must be in the vocabulary."""
        unknown = set(text) - self._index.keys()
        if unknown:
            raise UserError(f"{len(unknown)} character(s) ({listing(map(repr, sorted(unknown)), 12)}) are not in the {self.vocab_size}-character "
                            f"vocabulary of {self.name}; use only characters that occur in it.")
        dtype = torch.uint8 if self.vocab_size <= 256 else torch.int32
        return torch.tensor([self._index[c] for c in text], dtype=dtype)

    def decode(self, tokens) -> str:
        """The text of `tokens` (a tensor of any shape, read in order, or a list of ints)."""
        return "".join(self.chars[i] for i in torch.as_tensor(tokens).reshape(-1).tolist())


def load_text(path: str | Path = GENESIS) -> CharText:
    """A UTF-8 text file as a CharText; by default the shipped Book of Genesis (196,818 characters, 60 of them
    distinct)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path} was not found; pass an existing UTF-8 text file.") from None
    except (UnicodeDecodeError, IsADirectoryError, PermissionError) as err:
        raise UserError(f"{path} is not a readable UTF-8 text file ({type(err).__name__}); pass one.") from None
    return CharText(text, name=path.name)


class WindowLoader:
    """Batches of (x, y): x int64 batch_size x block_size windows of `tokens`, y the same windows one token on.

    Training: the epoch's windows start at offset + i * block_size, with one offset in [0, block_size) drawn
    per epoch from (seed, epoch), so epochs cut the text at different places; their count is the same every
    epoch (that of the largest offset). Window i is sample i of a MemoryLoader, which shuffles, shards and
    drops exactly as it does for images: micro-step k is the same windows for any world size W and batch B
    with the same W x B, and G consecutive micro-batches of B/G cover the windows of one batch of B.
    Evaluation (train=False): offset 0, every whole window of the text once, rank r taking windows r::W.
    """

    resumes_mid_epoch = True  # the trainer's epoch_batches then calls set_epoch(epoch, start_batch)

    def __init__(self, tokens: torch.Tensor, block_size: int, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, train: bool = True, device="cpu", drop_last=None):
        if tokens.ndim != 1 or tokens.is_floating_point() or block_size < 1:
            raise ValueError(f"expected 1-D integer tokens and block_size >= 1, got {tokens.dtype} "
                             f"{tuple(tokens.shape)} and {block_size}")
        # The last window's y must end inside the text: at any offset below block_size when training.
        count = len(tokens) // block_size - 1 if train else (len(tokens) - 1) // block_size
        if count < 1:
            raise UserError(f"{len(tokens)} tokens hold no {'training' if train else 'validation'} window of "
                            f"{block_size} + 1 tokens; lower the block size or use a longer text.")
        self.tokens, self.block_size, self.seed, self.train = tokens.to(device), block_size, seed, train
        self._span = torch.arange(block_size, device=device)
        # Window i is sample i of this loader: its labels are the window indices, in its order and sharding.
        placeholder = torch.zeros((), dtype=torch.uint8, device=device).expand(count, *_PLACEHOLDER_SHAPE)
        self.order = MemoryLoader(placeholder, torch.arange(count), batch_size, rank=rank, world_size=world_size,
                                  seed=seed, train=train, device=device, drop_last=drop_last, augment="none")
        self.num_samples = self.order.num_samples  # this rank's windows per epoch
        self.samples_per_epoch = self.order.samples_per_epoch  # all ranks' windows per epoch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (it seeds the shuffle and the offset); the next iteration starts at micro-step
        `start_batch` of it, later ones at micro-step 0."""
        self.order.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        """Batches per full epoch on this rank (the same on every rank when training)."""
        return len(self.order)

    def offset(self, epoch: int) -> int:
        """Where epoch `epoch`'s first training window starts (0 for evaluation)."""
        if not self.train:
            return 0
        generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch, _OFFSET_STREAM))
        return int(torch.randint(self.block_size, (), generator=generator))

    def __iter__(self):
        return self._batches(iter(self.order), self.offset(self.order.epoch))

    def _batches(self, windows, offset: int):
        for _, index in windows:
            rows = (offset + index * self.block_size)[:, None] + self._span
            yield self.tokens[rows].long(), self.tokens[rows + 1].long()


def window_dataset(tokens: torch.Tensor, block_size: int) -> torch.utils.data.TensorDataset:
    """Every whole window of `tokens` once, as (x, y) int64 pairs of block_size tokens, y one token on: a dataset
    for a prepared evaluation DataLoader (gather_for_metrics then counts each window once on any world size)."""
    count = (len(tokens) - 1) // block_size
    if count < 1:
        raise UserError(f"{len(tokens)} tokens hold no window of {block_size} + 1 tokens; lower the block size "
                        "or use a longer text.")
    rows = (torch.arange(count) * block_size)[:, None] + torch.arange(block_size)
    return torch.utils.data.TensorDataset(tokens[rows].long(), tokens[rows + 1].long())
