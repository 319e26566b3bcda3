"""Each injected bug in tests/mutations.py turns at least one test red: the suite's key invariants (parity,
resume, averaging, exact evaluation, one writer) are guarded by tests that can fail.

Each case runs the cheapest tests that catch its bug in a fresh pytest with the bug applied to every process
(tests/mutant/sitecustomize.py) and expects them to FAIL, and the bug to have been applied in some process.
The fresh pytest is forked from tests/scripts/mutation_zygote.py, which has imported torch and the other
libraries once for all of them (about 2 s each), and nothing of the toolkit.
"""

import importlib
import importlib.util
import json
import os
import select
import subprocess
from pathlib import Path

import pytest
from conftest import PY, ROOT, SCRIPTS, clean_env, kill_groups
from mutations import MUTATIONS, Mutation, SourceEdit, Stale

MUTANT = ROOT / "tests" / "mutant"


@pytest.fixture(scope="module")
def zygote():
    proc = subprocess.Popen([PY, SCRIPTS / "mutation_zygote.py"], cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    yield proc
    kill_groups([proc])


def pytest_with_the_bug(zygote, name, tmp_path, tests, timeout=300) -> tuple[int, str]:
    """(exit code, output) of `pytest -q -x tests` with mutation `name` applied to every process it starts."""
    output, pythonpath = tmp_path / "output.txt", os.pathsep.join([str(MUTANT), os.environ.get("PYTHONPATH", "")])
    request = {"args": ["-q", "-x", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "pytest"), *tests],
               "env": {"TOOLKIT_MUTATION": name, "TOOLKIT_MUTATION_LOG": str(tmp_path / "applied.txt"),
                       "PYTHONPATH": pythonpath}, "output": str(output)}
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    if not select.select([zygote.stdout], [], [], timeout)[0]:
        pytest.fail(f"{name}: pytest ran over {timeout} s")
    line = zygote.stdout.readline()
    assert line.strip().lstrip("-").isdigit(), f"the zygote answered {line!r}"
    return int(line), output.read_text()


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_injected_bug_turns_a_test_red(name, tmp_path, zygote):
    mutation, log = MUTATIONS[name], tmp_path / "applied.txt"
    if mutation.needs and importlib.util.find_spec(mutation.needs) is None:
        pytest.skip(f"{name}: the tests that catch it need {mutation.needs}, not installed (.ci/run installs it)")
    try:  # the code it changes is still there, as it names it
        mutation.check(_source(mutation.module) if isinstance(mutation.patch, SourceEdit)
                       else importlib.import_module(mutation.module))
    except Stale as stale:
        pytest.fail(f"{name} no longer applies: {stale}", pytrace=False)
    code, output = pytest_with_the_bug(zygote, name, tmp_path, mutation.caught_by)
    tail = output[-5000:]
    assert log.exists() and f"{name} applied to {mutation.module}" in log.read_text(), tail
    # pytest's exit code 1 is "tests failed" (a failed assertion, or a launch the bug broke in a fixture the
    # test needs: an error); 2-5 (interrupted, internal error, usage, nothing collected) are not
    last = output.splitlines()[-1]
    assert code == 1 and (" failed" in last or " error" in last), f"{mutation.breaks}: stayed green\n{tail}"
    print(f"{name}: {last}")


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_a_mutation_that_no_longer_applies_says_so_in_one_line():
    """A renamed function, a moved recipe line: the mutation says which, instead of staying green."""
    gone = Mutation("toolkit.train.cost", "StepCost.waited_for_data", lambda original, module: original, (), "")
    with pytest.raises(Stale, match=r"^toolkit\.train\.cost has no StepCost\.waited_for_data$"):
        gone.check(importlib.import_module("toolkit.train.cost"))
    clip = MUTATIONS["clipping-on-micro-steps"]
    source = _source("recipes.cifar")
    with pytest.raises(Stale, match=r"^the recipe has no function train$"):
        clip.patch.rewrite(source, "train")
    moved = source.replace("if accelerator.sync_gradients and cfg.clip_grad_norm:", "if cfg.clip_grad_norm:")
    with pytest.raises(Stale, match=r"^main's lines 'if accelerator.sync_gradients and cfg.clip_grad_norm:' occur 0 "
                                    r"times, not once$"):
        clip.patch.rewrite(moved, "main")


def test_a_recipe_edit_applies_to_the_same_lines_indented_and_commented_otherwise():
    """Reformatting the recipe (2-space indentation, another comment) changes nothing for its mutations."""
    source = _source("recipes.cifar")
    reformatted = "\n".join(line[:len(line) - len(line.lstrip(" "))][::2] + line.lstrip(" ") for line in
                            source.splitlines()).replace("# the whole step's gradient, once", "# once per step")
    for name in ("clipping-on-micro-steps", "ema-every-micro-step"):
        mutation = MUTATIONS[name]
        edited = mutation.patch.rewrite(reformatted, mutation.target)
        compile(edited, "cifar.py", "exec")  # indented as the lines it replaced
        assert edited != reformatted and mutation.patch.rewrite(source, "main") != source
    assert "\n" + " " * 10 + "if cfg.clip_grad_norm:\n" in MUTATIONS["clipping-on-micro-steps"].patch.rewrite(
        reformatted, "main")


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
