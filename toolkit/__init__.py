"""A distributed-training toolkit: one Accelerator-API contract over four engines.

>>> import toolkit
>>> accelerator = toolkit.build_accelerator()   # engine chosen from how the process was launched
"""

from toolkit.engines import ENGINES, build_accelerator, resolve_engine
from toolkit.config import parse_config
from toolkit.errors import UserError
from toolkit.launch.env import LaunchEnv, read_launch_env
from toolkit.launch.spawn import spawn

__all__ = ["ENGINES", "LaunchEnv", "UserError", "build_accelerator", "parse_config", "read_launch_env", "resolve_engine",
           "spawn"]
__version__ = "0.1.0"
