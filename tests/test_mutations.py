"""Each injected bug in tests/mutations.py turns at least one test red: the suite's key invariants (parity,
resume, averaging, exact evaluation, one writer) are guarded by tests that can fail.

Each case runs the cheapest tests that catch its bug in a fresh pytest with the bug applied to every process
(tests/mutant/sitecustomize.py) and expects them to FAIL, and the bug to have been applied in some process.
"""

import os

import pytest

from conftest import PY, ROOT, run
from mutations import MUTATIONS

MUTANT = ROOT / "tests" / "mutant"


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_injected_bug_turns_a_test_red(name, tmp_path):
    mutation, log = MUTATIONS[name], tmp_path / "applied.txt"
    pythonpath = os.pathsep.join([str(MUTANT), os.environ.get("PYTHONPATH", "")])
    proc = run([PY, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--basetemp", tmp_path / "pytest",
                *mutation.caught_by], check=False, timeout=300, TOOLKIT_MUTATION=name, TOOLKIT_MUTATION_LOG=log,
               PYTHONPATH=pythonpath)
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert log.exists() and f"{name} applied to {mutation.module}" in log.read_text(), tail
    # pytest's exit code 1 is "tests failed" (a failed assertion, or a launch the bug broke in a fixture the
    # test needs: an error); 2-5 (interrupted, internal error, usage, nothing collected) are not
    last = proc.stdout.splitlines()[-1]
    assert proc.returncode == 1 and (" failed" in last or " error" in last), f"{mutation.breaks}: stayed green\n{tail}"
    print(f"{name}: {proc.stdout.splitlines()[-1]}")


def test_ci_runs_exactly_the_readme_test_command():
    """`.ci/run` runs the README's test command, which shows every skip and its reason (-rs), in a fresh venv."""
    readme = (ROOT / "README.md").read_text().splitlines()
    command = readme[readme.index("# Set up and run the tests") + 1]
    assert "python -m pytest" in command and "-rs" in command.split()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command
    # in a virtual environment made anew inside the clone, ignored by git: what a newcomer's install brings
    made = [ci.index(line) for line in ("rm -rf .venv", "python -m venv .venv", ". .venv/bin/activate")]
    assert made == sorted(made) and ".venv/" in (ROOT / ".gitignore").read_text().splitlines()
