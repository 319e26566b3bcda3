"""A distributed-training toolkit: one Accelerator-API contract over five engines.

>>> import toolkit
>>> accelerator = toolkit.build_accelerator()   # engine chosen from how the process was launched
"""

from toolkit.engines import ENGINES, build_accelerator, resolve_engine
from toolkit.engines.observers import observe_engines
from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.launch.env import LaunchEnv, read_launch_env
from toolkit.launch.spawn import spawn


def _parity_recorder(engine):
    """`toolkit parity`'s recorder for each engine built here (None unless TOOLKIT_PARITY_DIR asks for one)."""
    from toolkit.check.capture import build_recorder  # imported when an engine is built, not by `import toolkit`

    return build_recorder(engine)


# Here, not in the engines: every script imports this package, and the check layer sits above the engines.
observe_engines(_parity_recorder)

__all__ = ["ENGINES", "LaunchEnv", "UserError", "build_accelerator", "parse_config", "read_launch_env", "resolve_engine",
           "spawn"]
__version__ = "0.1.0"
