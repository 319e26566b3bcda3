"""How the suite's tests share this machine under pytest-xdist: the `alone` marker's lock and order (hooks that
tests/conftest.py takes in). Nothing here imports torch or the toolkit, so tests/test_alone.py can run these
hooks in a session of their own cheaply."""

import fcntl
from pathlib import Path

import pytest


def is_alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


def pytest_collection_modifyitems(config, items):
    """The `alone` tests first: each leads its file, so the wait for the machine to empty
    (pytest_runtest_protocol) falls at a file's start, and one wait serves tests that follow each other, not one
    behind each file's minute of launches. Their files lead the collection too, which pytest-xdist's own order
    (by number of tests per file, its default) then overrides."""
    leading = {item.path for item in items if is_alone(item)}
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (item.path not in leading, order[item.path], not is_alone(item)))


_held = {}  # this worker's open lock files while it holds the machine from one `alone` test to the next


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (the README runs the suite with `-n auto --dist loadfile`), tests of different files
    run side by side, except a test marked `alone`: it asserts a time bound measured on an idle machine, so it
    waits until the tests running elsewhere finish, and none starts until it ends (nor between it and an `alone`
    test right after it). The lock spans a test's whole protocol, so the module and session fixtures it sets up
    or tears down (a file's shared launches) count as running too. A readers-writer lock over files every
    worker sees, with a turnstile so that a waiting `alone` test is not starved."""
    if not hasattr(item.config, "workerinput"):  # one process: nothing runs beside this test
        return (yield)
    alone = is_alone(item)
    if not _held:
        folder = Path(item.config.option.basetemp).parent  # pytest-N/, above each worker's popen-gwK/ (xdist's)
        turnstile, machine = open(folder / "turnstile.lock", "a"), open(folder / "machine.lock", "a")
        _held.update(turnstile=turnstile, machine=machine)
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)  # only passes through: a waiting `alone` test holds it
        fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    try:
        return (yield)
    finally:
        if not (alone and is_alone(nextitem)):
            fcntl.flock(_held["machine"], fcntl.LOCK_UN)
            if alone:
                fcntl.flock(_held["turnstile"], fcntl.LOCK_UN)
            for lock in _held.values():
                lock.close()
            _held.clear()
