"""The suite's own `alone` marker (tests/machine_share.py): under pytest-xdist, a test that asserts a time bound runs
while nothing else does, counting another file's module fixture (its shared launches) as running."""

import json
import sys
import textwrap

from conftest import ROOT, run

SHARED = """
import json, time
import pytest

def record(name):
    start = time.time()
    time.sleep(1.0)
    with open("intervals.jsonl", "a") as f:
        f.write(json.dumps([name, start, time.time()]) + "\\n")
"""


def test_an_alone_test_never_overlaps_another_files_module_fixture(tmp_path):
    """Two files on two workers: one whose work is all in a module fixture, one with two `alone` tests.
    Whichever starts first, the others wait for it: no two intervals overlap."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT / "tests")!r})
        from machine_share import pytest_runtest_protocol  # the suite's lock, as tests/conftest.py takes it in
        """))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: runs while no other test does\n")
    (tmp_path / "test_fixture.py").write_text(SHARED + textwrap.dedent("""
        @pytest.fixture(scope="module")
        def launches():
            record("module fixture")

        def test_uses_it(launches):
            pass
        """))
    (tmp_path / "test_timed.py").write_text(SHARED + textwrap.dedent("""
        @pytest.mark.alone
        def test_timed():
            record("alone")

        @pytest.mark.alone
        def test_timed_next():  # holds the machine over from the one before
            record("alone next")
        """))
    run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
         "--basetemp", tmp_path / "base", tmp_path], cwd=tmp_path, timeout=120)
    intervals = sorted(json.loads(line) for line in (tmp_path / "intervals.jsonl").read_text().splitlines())
    assert [name for name, _, _ in intervals] == ["alone", "alone next", "module fixture"]
    for first, (name, start, end) in enumerate(intervals):
        for other, other_start, other_end in intervals[first + 1:]:
            assert end <= other_start or other_end <= start, (name, other, intervals)
