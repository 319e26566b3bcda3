"""What `prepare` returns on the plain-PyTorch engines: an optimizer that steps once per accumulated batch
(and leaves the GradScaler to the engine), a scheduler that ticks with it, and a data loader that shards
by rank, moves batches to the device and knows which samples of the last batch are padding. Each carries the
public names of Accelerate's `AcceleratedOptimizer`, `AcceleratedScheduler` and `DataLoaderShard`, with their
meaning (tests/test_prepared_names.py compares them by `dir()`).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from toolkit.engines.samplers import DatasetOrder, RankShare, SkipFirst
from toolkit.engines.workers import stopped_at_exit
from toolkit.errors import UserError


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

    def train(self):
        """Accelerate's: the wrapped optimizer's train mode, where it has one (schedule-free optimizers average
        their weights differently for training and evaluation); nothing otherwise."""
        _call_mode(self.optimizer, "train")

    def eval(self):
        """Accelerate's: the wrapped optimizer's eval mode, where it has one; nothing otherwise."""
        _call_mode(self.optimizer, "eval")


def _call_mode(optimizer, mode: str):
    """optimizer.train() / .eval() when it has it, else that of the optimizer it wraps (as Accelerate looks one
    level down, for DeepSpeed's wrapper)."""
    for holder in (optimizer, getattr(optimizer, "optimizer", None)):
        if callable(getattr(holder, mode, None)):
            getattr(holder, mode)()
            return


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

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def get_lr(self):
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        """Accelerate's: the wrapped scheduler's (torch 2.14's schedulers no longer have one, there as here)."""
        return self.scheduler.print_lr(*args, **kwargs)

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict):
        self.scheduler.load_state_dict(state_dict)


class PreparedDataLoader:
    """A DataLoader re-sharded by rank (each epoch's order set automatically) that moves batches to the device,
    knows which samples of each batch are sampler padding, and where it stands in its epoch (saved by save_state,
    resumed with skip_first_batches). The order of the whole dataset is a sampler of its own (`get_sampler`, which
    `set_sampler` replaces); each rank takes its share of it as DistributedSampler would."""

    # Accelerate's DataLoaderShard state, per loader: whether the batch being handed out is the epoch's last, and
    # how many samples the last global batch holds (-1 before an epoch starts or when the loader drops it).
    end_of_dataloader = False
    remainder = -1

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
        self.resume_batches = 0  # a stateful load_state_dict: the batches the next epoch's iteration leaves out
        self.stateful = False  # state_dict / load_state_dict work (below)
        if isinstance(loader.dataset, IterableDataset) or loader.batch_size is None:
            self.loader = loader  # nothing to re-shard: the user's dataset decides
            return
        self.sampler = parent.sampler if parent is not None else RankShare(
            DatasetOrder(len(loader.dataset), shuffle=isinstance(loader.sampler, RandomSampler),
                         seed=engine.data_order_seed()),
            engine.data_parallel_size, engine.data_parallel_index)
        self.stateful = engine.use_stateful_dataloader
        self.per_process_batch = _per_process_batch(loader.batch_size, engine)
        sampler = SkipFirst(self.sampler, skip_batches * self.per_process_batch) if skip_batches else self.sampler
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

    @property
    def real_samples(self) -> int:
        """This rank's samples that are not padding: the split pads with repeats so every rank has as many."""
        return len(range(self.sampler.rank, len(self.sampler.order), self.sampler.world))

    @property
    def total_dataset_length(self) -> int:
        """Accelerate's: the dataset's `total_length` where it gives one, else its length."""
        return self.dataset.total_length if hasattr(self.dataset, "total_length") else len(self.dataset)

    def get_sampler(self):
        """Accelerate's: the sampler that orders the whole dataset, before each rank takes its share."""
        if self.sampler is None:
            return getattr(self.loader.batch_sampler, "sampler", None)
        return self.sampler.order

    def set_sampler(self, sampler):
        """Accelerate's: order the whole dataset by `sampler` from the next epoch on; each rank still takes its
        share of that order (a sampler given here is never iterated whole on every rank)."""
        if self.sampler is None:
            raise UserError(f"set_sampler needs a loader over a map-style dataset with a batch size; this one's "
                            f"{type(self.dataset).__name__} decides its own order, so give it the order instead.")
        if not hasattr(sampler, "__len__"):
            raise UserError(f"set_sampler needs a sampler with a length, so that every rank gets as many samples; "
                            f"{type(sampler).__name__} has none.")
        self.sampler.order = sampler

    def state_dict(self) -> dict:
        """Accelerate's stateful loader (DataLoaderConfiguration(use_stateful_dataloader=True)): where this loader
        stands, its epoch and the samples of the epoch's order handed out over all ranks."""
        if not self.stateful:
            raise UserError(self._stateless("state_dict"))
        owner = self._owner()
        return {"epoch": owner.epoch, "batches": owner.batches_seen,
                "samples": owner.batches_seen * self.per_process_batch * self.engine.data_parallel_size}

    def load_state_dict(self, state_dict: dict):
        """The next iteration goes on in the saved epoch, after the samples it had handed out (on any number of
        ranks whose global batches tile them)."""
        if not self.stateful:
            raise UserError(self._stateless("load_state_dict"))
        self.set_position(state_dict)
        self.resume_batches = self.batches_seen = self._batches_for(state_dict)

    def _batches_for(self, state: dict) -> int:
        if "samples" not in state:
            return int(state.get("batches", 0))
        per_step = self.per_process_batch * self.engine.data_parallel_size
        if state["samples"] % per_step:
            raise UserError(f"the loader's state was saved {state['samples']} samples into its epoch, which "
                            f"{self.engine.data_parallel_size} process(es) x batch {self.per_process_batch} cannot resume "
                            f"exactly; resume with a global batch that divides {state['samples']}.")
        return state["samples"] // per_step

    def _stateless(self, method: str) -> str:
        if self.sampler is None:
            return (f"loader.{method}() needs a loader over a map-style dataset with a batch size under the "
                    f"{self.engine.name} engine; use the accelerate engine for a stateful loader over this one.")
        return (f"loader.{method}() belongs to stateful loaders: build the accelerator with dataloader_config="
                f"DataLoaderConfiguration(use_stateful_dataloader=True), as in Accelerate.")

    def __len__(self):
        return len(self.loader)

    @property
    def total_batch_size(self):
        return self.batch_size if self.engine.split_batches else self.batch_size * self.engine.data_parallel_size

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
        if self.resume_batches:  # after a stateful load_state_dict: this epoch, without what it had handed out
            skip, self.resume_batches = self.resume_batches, 0
            yield from self.skipping(skip)
            return
        engine, seen = self.engine, self.skip_batches * (getattr(self, "per_process_batch", None) or 0)
        real = self.real_samples if self.sampler is not None else None  # once an epoch: set_sampler may change it
        owner.batches_seen = self.skip_batches
        engine.end_of_dataloader = self.end_of_dataloader = owner.end_of_dataloader = False
        self.remainder = owner.remainder = -1
        if not self.base_dataloader.drop_last:
            with contextlib.suppress(TypeError):  # a dataset without a length has no remainder (Accelerate: -1)
                length = getattr(self.dataset, "total_dataset_length", None) or len(self.dataset)  # Accelerate's rule
                self.remainder = owner.remainder = length % self.total_batch_size
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
                self.valid_in_batch = (size, max(0, min(size, real - seen)))
                seen += size
            engine.end_of_dataloader = self.end_of_dataloader = owner.end_of_dataloader = upcoming is None
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
    readers = engine.data_parallel_size
    if batch_size % readers:
        from toolkit.errors import UserError

        raise UserError(f"split_batches needs a batch size that {readers} processes divide evenly, not "
                        f"{batch_size}; use a multiple of {readers}.")
    return batch_size // readers


def _batch_len(batch):
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return None
