"""A distributed-training toolkit: one Accelerator-API contract over five engines.

>>> import toolkit
>>> accelerator = toolkit.build_accelerator()   # engine chosen from how the process was launched
"""

from toolkit.engines import ENGINES, build_accelerator, resolve_engine
from toolkit.engines.observers import observe_engines
from toolkit.launch.parallelism import ParallelismConfig
from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.launch.env import LaunchEnv, read_launch_env
from toolkit.launch.ray_train import ray_fit, ray_train_func
from toolkit.launch.spawn import spawn


def _parity_recorder(engine):
    """`toolkit parity`'s recorder for each engine built here (None unless TOOLKIT_PARITY_DIR asks for one)."""
    from toolkit.check.capture import build_recorder  # imported when an engine is built, not by `import toolkit`

    return build_recorder(engine)


# Here, not in the engines: every script imports this package, and the check layer sits above the engines.
observe_engines(_parity_recorder)

# The training parts a recipe's loop calls (toolkit/train), imported on first use: `import toolkit` stays light
# for the launcher, which never trains.
_TRAINING_PARTS = ("EvalMetrics", "TrainingConfig", "TrainingRun", "apply_preset", "check_config", "plan_batches",
                   "run_guard")


def __getattr__(name):
    if name in _TRAINING_PARTS:
        import toolkit.train

        return getattr(toolkit.train, name)
    raise AttributeError(f"module 'toolkit' has no attribute {name!r}")


__all__ = ["ENGINES", "LaunchEnv", "ParallelismConfig", "UserError", "build_accelerator", "parse_config", "ray_fit",
           "ray_train_func", "read_launch_env", "resolve_engine",
           "spawn", *_TRAINING_PARTS]
__version__ = "0.1.0"
