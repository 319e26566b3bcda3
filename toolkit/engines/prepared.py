"""What `prepare` returns on the plain-PyTorch engines: an optimizer that steps once per accumulated batch
(and leaves the GradScaler to the engine), a scheduler that ticks with it, and a data loader that shards
by rank, moves batches to the device and knows which samples of the last batch are padding.
"""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from toolkit.engines.workers import stopped_at_exit


def move_to(batch, device):
    """Move every tensor in a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


def map_tensors(fn, data):
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, d) for d in data)
    if isinstance(data, dict):
        return {k: map_tensors(fn, v) for k, v in data.items()}
    return data


class PreparedOptimizer(torch.optim.Optimizer):
    """Steps only when gradients are synced (the last micro-step of an accumulation), through the scaler."""

    # Deliberately no super().__init__: this is a view of an existing optimizer, as Accelerate's is.
    def __init__(self, optimizer: torch.optim.Optimizer, engine):
        self.optimizer = optimizer
        self.engine = engine
        self.step_was_skipped = False

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    def zero_grad(self, set_to_none: bool = True):
        if self.engine.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        if not self.engine.sync_gradients:
            return
        first = self.engine._optimizers[:1]  # the first optimizer's steps count: a GAN's two step once each
        self.engine.optimizer_steps += bool(first) and first[0] is self
        scaler = self.engine.scaler
        if scaler is None:
            self.optimizer.step(closure)
            self.step_was_skipped = False
            return
        if not has_gradients(self.optimizer):
            # No backward since the last step (--skip-nonfinite skipped it on every micro-step): the scaler
            # recorded no inf checks, so scaler.step would raise. Nothing to apply: skip and count.
            self.step_was_skipped = True
            self.engine.skipped_steps += 1
            return
        scale = scaler.get_scale()
        scaler.step(self.optimizer, closure)
        scaler.update()
        self.step_was_skipped = scaler.get_scale() < scale  # the scaler backed off: inf/nan gradients
        self.engine.skipped_steps += self.step_was_skipped

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self.optimizer.add_param_group(param_group)


def has_gradients(optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


class PreparedScheduler:
    """Accelerate's scheduler meaning: step on optimizer steps only, `num_processes` ticks per step
    (schedules are written in single-process steps) unless `split_batches`."""

    def __init__(self, scheduler, engine):
        self.scheduler = scheduler
        self.engine = engine

    def step(self, *args, **kwargs):
        engine = self.engine
        if not engine.step_scheduler_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not engine.sync_gradients or any(o.step_was_skipped for o in engine._optimizers):
            return
        for _ in range(1 if engine.split_batches else engine.num_processes):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.scheduler, name)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)


class PreparedDataLoader:
    """A DataLoader re-sharded with a DistributedSampler (set_epoch every epoch, automatically) that moves
    batches to the device, knows which samples of each batch are sampler padding, and where it stands in its
    epoch (saved by save_state, resumed with skip_first_batches)."""

    def __init__(self, loader: DataLoader, engine, skip_batches: int = 0, parent=None):
        self.engine = engine
        self.epoch = 0
        self.batches_seen = 0  # batches of the current epoch handed out so far
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.base_dataloader = loader
        self.skip_batches = skip_batches
        self.parent = parent  # a skip_first_batches view shares its parent's epoch counter
        self.sampler = None
        self.valid_in_batch = None
        if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
            self.loader = loader  # nothing to re-shard: the user's dataset decides
            return
        self.sampler = parent.sampler if parent is not None else DistributedSampler(
            loader.dataset,
            num_replicas=engine.num_processes,
            rank=engine.process_index,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=engine.data_order_seed(),
        )
        self.per_process_batch = _per_process_batch(loader.batch_size, engine)
        sampler = _SkipFirst(self.sampler, skip_batches * self.per_process_batch) if skip_batches else self.sampler
        kwargs = dict(
            batch_size=self.per_process_batch,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            worker_init_fn=loader.worker_init_fn,
            persistent_workers=loader.persistent_workers,
            generator=loader.generator,  # each epoch's worker seed comes from it, not from the global RNG
        )
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        self.loader = DataLoader(loader.dataset, **kwargs)
        if loader.persistent_workers:  # its workers may ignore SIGTERM (toolkit.engines.workers): stopped here
            stopped_at_exit(self.loader)
        # DistributedSampler pads with repeats so every rank has as many samples: count the real ones.
        n, world, rank = len(loader.dataset), engine.num_processes, engine.process_index
        self.real_samples = len(range(rank, n, world))

    def __len__(self):
        return len(self.loader)

    @property
    def total_batch_size(self):
        return self.batch_size if self.engine.split_batches else self.batch_size * self.engine.num_processes

    def set_epoch(self, epoch: int):
        self._owner().epoch = epoch

    def _owner(self):
        return self.parent if self.parent is not None else self

    def position(self) -> dict:
        """Where this loader stands: its epoch and the batches of it already handed out (state.json keeps it)."""
        return {"epoch": self.epoch, "batches": self.batches_seen}

    def set_position(self, position: dict):
        """Continue in the saved epoch (same shuffle); skip_first_batches(loader, position["batches"]) skips
        what was already trained on, as in Accelerate's mid-epoch resume."""
        self.epoch, self.batches_seen = int(position.get("epoch", 0)), int(position.get("batches", 0))

    def skipping(self, num_batches: int) -> "PreparedDataLoader":
        if num_batches < 0:
            raise ValueError(f"num_batches must be at least 0, not {num_batches}")
        return PreparedDataLoader(self.base_dataloader, self.engine, skip_batches=num_batches, parent=self)

    def __iter__(self):
        owner = self._owner()
        if self.sampler is not None:
            self.sampler.set_epoch(owner.epoch)
        if hasattr(self.dataset, "set_epoch"):  # a dataset that seeds per-epoch augmentation, as Accelerate allows
            self.dataset.set_epoch(owner.epoch)
        engine, seen = self.engine, self.skip_batches * (getattr(self, "per_process_batch", None) or 0)
        owner.batches_seen = self.skip_batches
        engine.end_of_dataloader = False
        iterator = iter(self.loader)
        try:
            batch = next(iterator)
        except StopIteration:
            return
        while True:
            try:  # look one batch ahead so the last batch is known before it is used
                upcoming = next(iterator)
            except StopIteration:
                upcoming = None
            size = _batch_len(batch)
            if self.sampler is not None and size is not None:
                self.valid_in_batch = (size, max(0, min(size, self.real_samples - seen)))
                seen += size
            engine.end_of_dataloader = upcoming is None
            engine._active_loader = self
            owner.batches_seen += 1
            yield move_to(batch, engine.device) if engine.device_placement else batch
            if upcoming is None:
                break
            batch = upcoming
        engine._active_loader = None
        engine.end_of_dataloader = False
        owner.epoch += 1
        owner.batches_seen = 0


def _per_process_batch(batch_size: int, engine) -> int:
    """Each process's batch: the loader's, or with split_batches its share of it (Accelerate's rule)."""
    if not engine.split_batches:
        return batch_size
    if batch_size % engine.num_processes:
        from toolkit.errors import UserError

        raise UserError(f"split_batches needs a batch size that {engine.num_processes} processes divide evenly, not "
                        f"{batch_size}; use a multiple of {engine.num_processes}.")
    return batch_size // engine.num_processes


class _SkipFirst(torch.utils.data.Sampler):
    """The sampler's indices without the first `count` (the samples of the batches a resume skips)."""

    def __init__(self, sampler, count: int):
        self.sampler, self.count = sampler, count

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self):
        return max(0, len(self.sampler) - self.count)


def _batch_len(batch):
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return None
