"""The world of processes the ddp and fsdp engines share: forming (or joining) the `torch.distributed` group,
each rank's device, the collectives, and tearing it down. The accelerate engine forms Accelerate's group with the
same store and NCCL settings.

NCCL on CUDA, gloo on CPU. Each process pins `cuda:<local_rank>`; the rendezvous comes from the environment
torchrun (or `toolkit launch`, srun, mpirun) set, as `read_launch_env` read it.
"""

from __future__ import annotations

import datetime
import gc

import torch
import torch.distributed as dist

from toolkit.engines.accelerate_settings import release_accelerate_state
from toolkit.errors import UserError

DEFAULT_TIMEOUT_S = 600


def attempt_store(env, host: str, port: int, wait: datetime.timedelta) -> dist.Store:
    """The rendezvous store of this attempt of the worker group. torchrun's agent keeps one store across
    restarts, so a restarted group meeting there (as env:// does) can read the dead attempt's gloo addresses
    and hang connecting to them; a fresh key space per attempt keeps them apart. Without the agent's store
    (a multi-node restart through toolkit launch, where nodes' restart counts differ) rank 0 hosts a store of
    this round alone: nothing stale to keep apart."""
    store = dist.TCPStore(host, port, env.world_size, is_master=env.rank == 0 and not env.agent_store,
                          timeout=wait, multi_tenant=True)
    return dist.PrefixStore(f"toolkit/attempt-{env.restart_count}", store) if env.agent_store else store


def nccl_error_handling(environ=None):
    """Before an NCCL group forms: when a collective times out (a peer died or stopped), abort the
    communicators but keep this process alive (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, CleanUpOnly). The rank
    blocked on the dead peer then gets a Python error it can turn into the one-sentence peer-failure message,
    and its Ctrl-C/SIGTERM handler runs; torch's default (3) kills the process from the watchdog instead.
    A value the user set is kept."""
    import os

    environ = os.environ if environ is None else environ
    environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def release_ddp_wrappers(wrapped: list):
    """Drop what ties each DDP-wrapped model (weak references in `wrapped`) to the destroyed group: its
    reducer, logger and group, so they are freed now, while the interpreter is whole. Freed during interpreter
    finalization instead, the group's gloo threads can abort the process ("terminate called without an active
    exception", a PyTorch teardown race that a loaded machine makes likelier). The unwrapped model stays
    usable; the DDP wrapper cannot train any more."""
    for ref in wrapped:
        model = ref()
        for name in ("logger", "reducer", "process_group"):
            if model is not None and name in model.__dict__:
                delattr(model, name)
    wrapped.clear()
    gc.collect()


class ProcessGroupMixin:
    """A world of `torch.distributed` ranks for an engine built on `TorchEngine` (listed before it, so these
    hooks replace the one-process ones): `_select_device`, the world's size and ranks, `wait_for_everyone`,
    `end_training`, `_all_gather`, `_all_reduce`, `_gather_objects`. The group is this engine's own unless one
    was formed before it (then it only joins). `_wrapped` holds weak references to the wrappers the engine made
    around the group (DDP modules), released when the group is destroyed."""

    def __init__(self, env, **kwargs):
        super().__init__(env, **kwargs)
        timeout = DEFAULT_TIMEOUT_S if self.timeout is None else self.timeout  # or InitProcessGroupKwargs'
        self._owns_group = False
        self._wrapped = []  # weak references to the DDP modules this engine made (none under fsdp)
        if not dist.is_initialized():
            self._init_group(env, timeout)
        self._rank, self._world = dist.get_rank(), dist.get_world_size()

    def _select_device(self):
        if self.use_cpu:
            return torch.device("cpu")
        local_rank, visible = self.env.local_rank, torch.cuda.device_count()
        if visible == 1:
            # srun --gpus-per-task=1, --gpu-bind or an MPI wrapper: each rank sees exactly its own GPU.
            local_rank = 0
        elif local_rank >= visible:
            raise UserError(
                f"local rank {local_rank} has no GPU: only {visible} visible on this node; "
                "launch at most that many processes per node."
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)

    def _init_group(self, env, timeout):
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl":
            nccl_error_handling()
        if env.world_size > 1 and (env.master_addr is None or env.master_port is None):
            raise UserError(f"the {self.name} engine needs MASTER_ADDR and MASTER_PORT; launch with torchrun or "
                            "toolkit launch.")
        wait = datetime.timedelta(seconds=timeout)
        if env.world_size == 1 and env.master_port is None:
            # A 1-process group needs a store but no peer to meet: an in-memory one takes no port (a port chosen
            # free and then bound can be taken in between, e.g. by a second group formed in the same process).
            store = dist.HashStore()
        else:
            store = attempt_store(env, env.master_addr, env.master_port, wait)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=wait,
                                device_id=self.device if self.device.type == "cuda" else None)
        self._owns_group = True

    process_index = property(lambda self: self._rank)
    local_process_index = property(lambda self: self.env.local_rank)
    num_processes = property(lambda self: self._world)

    def wait_for_everyone(self):
        dist.barrier()

    def end_training(self):
        self._finish_trackers()
        release_accelerate_state(self)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False
            release_ddp_wrappers(self._wrapped)

    def _all_gather(self, tensor, group=None):
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        size = torch.tensor([tensor.shape[0]], device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=group)
        sizes = torch.cat(sizes).tolist()  # one host sync, not one per rank
        longest = max(sizes)
        if tensor.shape[0] < longest:  # all_gather needs equal shapes: pad, then cut each piece back
            pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad])
        pieces = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(pieces, tensor, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes)])

    def _gather_objects(self, objects: list, group=None) -> list:
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, objects, group=group)
        return [obj for part in gathered for obj in part]

    def _all_reduce(self, tensor, op):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor / self._world if op == "mean" else tensor
