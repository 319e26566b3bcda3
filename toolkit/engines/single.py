"""One process, one device: the engine for a laptop, a notebook or one GPU."""

from toolkit.engines.base import TorchEngine


class SingleEngine(TorchEngine):
    """Every collective is the identity and every barrier a no-op: the world is this process."""

    name = "single"
