"""Ray Train: a recipe's `main` as the training function of Ray's `TorchTrainer` (pip install "toolkit[ray]").

    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    import toolkit
    from recipes.cifar import main

    trainer = TorchTrainer(toolkit.ray_train_func(main, ["--model", "tiny", "--output-dir", "/shared/runs/a"]),
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path="/shared/ray", name="a",
                                                failure_config=FailureConfig(max_failures=2)))
    result = toolkit.ray_fit(trainer)  # Ray's Result; a user error is one sentence and exit 2

What Ray does and what the toolkit reads of it:
- Ray forms the process group (gloo without GPUs, nccl with) before the function runs and sets RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and MASTER_PORT; read_launch_env names the launcher "ray",
  `auto` picks ddp as under torchrun, and every engine joins Ray's group and never destroys it.
- Ray starts each worker in a session folder of its own: the function goes back to the driver's folder, so the
  recipe's relative paths (--output-dir, --data-dir) mean what they mean on the driver.
- Every checkpoint the run saves is reported (toolkit/train/ray_report.py) and copied into Ray's storage; when a
  worker fails, Ray restarts every worker (up to FailureConfig.max_failures times) and `ray.train.get_checkpoint()`
  is the last reported one: the function resumes from it (--resume), exactly, as after a torchrun restart.
- Ray retries whatever fails in a worker group, FailureConfig.max_failures times, a user error (a bad flag, a
  missing dataset) too: Ray has no error it does not retry. When the last try fails with one, `ray_fit` says its
  sentence once and exits 2, where `fit()` would raise Ray's TrainingFailedError with each worker's traceback.
"""

from __future__ import annotations

import os
import sys

from toolkit.errors import UserError


def ray_train_func(main, argv):
    """The training function for `TorchTrainer(train_loop_per_worker=...)`: `main(argv)` in each Ray worker, resumed
    from Ray's last reported checkpoint after a restart; it returns what main returns. Ray's
    `train_loop_config={"argv": [...]}` adds flags."""
    folder = os.getcwd()  # the driver's: the function is built (and pickled) there
    argv = [str(word) for word in argv]
    module = sys.modules.get(getattr(main, "__module__", ""), None)
    if module is not None and module.__name__ != "__main__" and not module.__name__.startswith("toolkit"):
        from ray import cloudpickle

        # The recipe's module goes with the function, by value: Ray's workers need not find `recipes` on their path.
        cloudpickle.register_pickle_by_value(module)

    def train_func(config=None):
        import ray.train

        if os.path.isdir(folder):  # a worker on another machine may not have the driver's folder
            os.chdir(folder)
        words = argv + [str(word) for word in (config or {}).get("argv", ())]
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return main(words)
        with checkpoint.as_directory() as saved:  # Ray's storage: this folder, or a download of it
            return main(words + ["--resume", saved])

    return train_func


def ray_fit(trainer):
    """`trainer.fit()`'s Result; when the workers failed with a user error (a bad flag, missing data), its one
    sentence on stderr and exit 2 instead of Ray's traceback. Any other failure is Ray's to say."""
    try:
        return trainer.fit()
    except Exception as error:  # ray.train.TrainingFailedError: the exception of each failed worker, by rank
        failures = list((getattr(error, "worker_failures", None) or {}).values())
        said = next((failure for failure in failures if isinstance(failure, UserError)), None)
        if said is not None:
            print(f"error: {said}", file=sys.stderr, flush=True)
            raise SystemExit(said.exit_code) from None
        exits = [failure.code for failure in failures if isinstance(failure, SystemExit) and failure.code]
        if exits:  # a bad flag: the worker's parser said it (Ray shows the line) and exited 2
            raise SystemExit(exits[0]) from None
        raise
