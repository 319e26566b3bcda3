"""Observers of every engine's `prepare` and `backward`, registered from a higher layer: `toolkit parity`'s
recorder (toolkit/check/capture.py, registered by toolkit/__init__.py) watches a run through them, so the engines
never import the check layer.

>>> class Counter:
...     def __init__(self): self.prepared_objects = 0
...     def prepared(self, results): self.prepared_objects += len(results)
...     def backward(self, loss): pass
>>> counter = Counter()
>>> stop = observe_engines(lambda engine: counter)
>>> EngineObservers(engine=None).prepared([1, 2]); counter.prepared_objects
2
>>> stop()
"""

from __future__ import annotations

from collections.abc import Callable

_FACTORIES: list[Callable] = []


def observe_engines(factory: Callable) -> Callable[[], None]:
    """Call `factory(engine)` for every engine built from now on; what it returns (None: nothing to watch) gets
    `prepared(results)` after each `prepare` and `backward(loss)` before each `backward`. Returns the undo."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)
    return lambda: _FACTORIES.remove(factory) if factory in _FACTORIES else None


class EngineObservers:
    """The observers of one engine, built when it is (an engine calls both hooks; without observers they do nothing)."""

    def __init__(self, engine):
        self._observers = [o for o in (factory(engine) for factory in list(_FACTORIES)) if o is not None]

    def prepared(self, results):
        for observer in self._observers:
            observer.prepared(results)

    def backward(self, loss):
        for observer in self._observers:
            observer.backward(loss)
