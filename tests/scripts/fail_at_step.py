"""Run a recipe as `__main__` with a user error raised on one rank only, in the middle of a training step, as a
corrupt image file that only that rank decodes stops a real run (recipes/images.py): the other rank is then
waiting in the step's collective, which breaks when the failing rank exits.

    FAIL_RANK=0 FAIL_STEP=3 FAIL_SENTENCE="..." accelerate launch ... tests/scripts/fail_at_step.py recipes/cifar.py ...

The error is raised from the training loss (F.cross_entropy with the default mean reduction) of optimizer step
FAIL_STEP when there is no accumulation; evaluation's (reduction="none") is left alone.
"""

import os
import runpy
import sys

import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from toolkit.errors import UserError

RANK, STEP, SENTENCE = os.environ["FAIL_RANK"], int(os.environ["FAIL_STEP"]), os.environ["FAIL_SENTENCE"]
cross_entropy, calls = F.cross_entropy, [0]


def failing(*args, **kwargs):
    # Not the plan's simulated step (toolkit/plan), which runs the loss once on fake tensors before training.
    if kwargs.get("reduction", "mean") == "mean" and os.environ.get("RANK", "0") == RANK and not isinstance(
            args[0], FakeTensor):
        calls[0] += 1
        if calls[0] == STEP:
            raise UserError(SENTENCE)
    return cross_entropy(*args, **kwargs)


F.cross_entropy = failing
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
