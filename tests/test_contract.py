"""The Accelerator-API contract, for every engine, in one process (its own, since Accelerate's state
is a process-wide singleton)."""

import pytest

from conftest import PY, SCRIPTS, run
from toolkit import ENGINES


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_contract(engine):
    proc = run([PY, SCRIPTS / "contract.py", engine], timeout=120)
    assert f"CONTRACT OK {engine}" in proc.stdout


def test_ddp_engine_never_imports_accelerate():
    code = ("import sys, toolkit; a = toolkit.build_accelerator('ddp'); a.end_training(); "
            "print('accelerate' in sys.modules)")
    assert run([PY, "-c", code]).stdout.strip().splitlines()[-1] == "False"
