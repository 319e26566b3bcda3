"""recipes/cifar.py's main under Ray Train, as docs/multi-node.md shows it: a local Ray cluster of 2 CPUs, a
TorchTrainer of 2 CPU workers (gloo), checkpoints into STORAGE/NAME, FailureConfig(max_failures=FAILURES).

    python tests/scripts/ray_cifar.py STORAGE NAME FAILURES PIDS [recipe flags ...]

What the test reads besides the run's own records: each worker writes its pid to PIDS/rank<R> (to be killed),
and after main() returns whether Ray's process group is still there and usable to PIDS/group-alive-rank<R> (the
toolkit must never destroy a group it did not make). Prints `result: <Ray's Result.metrics as JSON>`.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import toolkit  # noqa: E402
from recipes.cifar import main  # noqa: E402


def build(argv, pids):
    recipe = toolkit.ray_train_func(main, argv)

    def train_func(config=None):
        import torch.distributed as dist

        (Path(pids) / f"rank{ray.train.get_context().get_world_rank()}").write_text(str(os.getpid()))
        recipe(config)
        alive = dist.is_initialized()
        if alive:
            dist.barrier()  # and usable
        (Path(pids) / f"group-alive-rank{dist.get_rank() if alive else os.environ['RANK']}").write_text(str(alive))

    return train_func


if __name__ == "__main__":
    storage, name, failures, pids, *argv = sys.argv[1:]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(build(argv, pids), scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                                           resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=storage, name=name,
                                                failure_config=FailureConfig(max_failures=int(failures))))
    try:
        result = toolkit.ray_fit(trainer)
        print("result:", json.dumps(result.metrics), flush=True)
    finally:
        ray.shutdown()
