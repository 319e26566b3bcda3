"""Tests only: the pytest runs of tests/test_mutations.py, each forked from this one process, which has already
imported what every run imports again (pytest, torch with torch._dynamo, accelerate, numpy, safetensors) and
nothing of the toolkit, the recipes or the tests.

One request per stdin line, JSON {"args", "env", "output"}; for each, a child takes `env` into its environment (the
processes it starts inherit it: TOOLKIT_MUTATION, PYTHONPATH with tests/mutant), installs the mutation's
import hook (tests/mutant/sitecustomize.py, as a fresh Python process would at start-up), writes its output to
`output` and runs pytest with `args`. This process answers each request with the child's exit code on one line.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import accelerate  # noqa: F401  imported here once, not again in each run
import numpy  # noqa: F401
import pytest
import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  what building any optimizer imports

ROOT = Path(__file__).resolve().parents[2]
SITECUSTOMIZE = ROOT / "tests" / "mutant" / "sitecustomize.py"
assert not any(name.split(".")[0] in ("toolkit", "recipes", "conftest", "mutations") for name in sys.modules)


def run(request: dict) -> None:
    """In the forked child: the mutation's environment and hook, then pytest; never returns."""
    code = 3
    try:
        os.environ.update(request["env"])
        sys.path[0] = str(ROOT)  # as `python -m pytest` run from the repository has it (this script's folder here)
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        spec = importlib.util.spec_from_file_location("mutant_sitecustomize", SITECUSTOMIZE)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        code = int(pytest.main(request["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    child = os.fork()
    if child == 0:
        run(request)
    _, status = os.waitpid(child, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
