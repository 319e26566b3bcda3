"""The fsdp engine's device mesh and its parts: the `pp` dimension pipeline stages run along, the data-parallel
dimensions FSDP shards over (`dp_replicate`, `dp_shard`), and the `tp` dimension tensor parallel splits layers over
(toolkit/launch/parallelism.py names and orders them). Ranks along `tp` and `pp` hold the same batch; the
data-parallel ranks read different ones."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.launch.parallelism import ParallelismConfig, mesh_shape


@dataclass
class Mesh:
    mesh: DeviceMesh  # every dimension
    data: DeviceMesh  # what FSDP shards over: dp_shard, or dp_replicate x dp_shard
    tp: DeviceMesh | None
    pp_size: int
    tp_size: int
    data_group: object  # the process group of this rank's data-parallel peers; None: every rank

    @property
    def data_parallel_size(self) -> int:
        return self.data.size()

    def data_parallel_index(self, rank: int) -> int:
        """This rank's place among the data-parallel ranks (tp innermost, pp outermost)."""
        return (rank // self.tp_size) % self.data_parallel_size


def build_mesh(config: ParallelismConfig | None, world: int, device_type: str, engine: str) -> Mesh:
    shape, names = ((world,), ("dp_shard",)) if config is None else mesh_shape(config, world, engine)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    data_names = tuple(name for name in names if name in ("dp_replicate", "dp_shard"))
    data = mesh[data_names[0]] if len(data_names) == 1 else mesh[data_names]
    split = len(data_names) < len(names)  # a tp or pp dimension besides: the data-parallel group is a subgroup
    group = None if not split else data.get_group() if data.ndim == 1 else data._flatten("dp").get_group()
    return Mesh(mesh, data, mesh["tp"] if "tp" in names else None, mesh.size(names.index("pp")) if "pp" in names
                else 1, mesh.size(names.index("tp")) if "tp" in names else 1, group)
