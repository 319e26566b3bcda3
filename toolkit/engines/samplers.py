"""The order a prepared loader hands out: the whole dataset's order in an epoch (what `get_sampler` returns and
`set_sampler` replaces, as in Accelerate), each rank's share of it as torch's DistributedSampler splits, and a
share without the batches a mid-epoch resume leaves out."""

from __future__ import annotations

import itertools
import math

import torch


class DatasetOrder(torch.utils.data.Sampler):
    """The whole dataset's order in an epoch: shuffled as DistributedSampler shuffles (a permutation seeded with
    seed + epoch, the same on every rank), or in index order."""

    def __init__(self, length: int, shuffle: bool, seed: int):
        self.length, self.shuffle, self.seed, self.epoch = length, shuffle, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())

    def __len__(self):
        return self.length


class RankShare(torch.utils.data.Sampler):
    """One rank's share of an order, as DistributedSampler splits (drop_last=False): the order padded with its own
    start to a multiple of the world size, then every `world`-th index from `rank`."""

    def __init__(self, order, world: int, rank: int):
        self.order, self.world, self.rank = order, world, rank

    def set_epoch(self, epoch: int):
        if hasattr(self.order, "set_epoch"):
            self.order.set_epoch(epoch)

    def __iter__(self):
        indices = list(self.order)
        total = len(self) * self.world
        if indices:
            indices += (indices * math.ceil(total / len(indices)))[:total - len(indices)]
        return iter(indices[self.rank:total:self.world])

    def __len__(self):
        return math.ceil(len(self.order) / self.world)


class SkipFirst(torch.utils.data.Sampler):
    """The sampler's indices without the first `count` (the samples of the batches a resume skips)."""

    def __init__(self, sampler, count: int):
        self.sampler, self.count = sampler, count

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.count)
