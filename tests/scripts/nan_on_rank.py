"""Run a recipe as `__main__` with the training loss made NaN on one rank at one step, so a test can check
what a NaN on a rank other than the main one does (TOOLKIT_DEBUG_NAN_STEP injects only on the main process).

    NAN_RANK=1 NAN_STEP=5 torchrun --nproc_per_node 2 tests/scripts/nan_on_rank.py recipes/cifar.py ...

The recipe's loss is torch.nn.functional.cross_entropy with the default mean reduction; evaluation's
(reduction="none") is left alone. Counting calls counts optimizer steps when there is no accumulation.

The main process waits a second before it claims the sentence, so the poisoned rank always says it while
the main process's progress bar is still on the shared terminal line (the case that once glued the two).
"""

import os
import runpy
import sys

import time

import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

import toolkit.errors

RANK, STEP = os.environ["NAN_RANK"], int(os.environ["NAN_STEP"])
cross_entropy, calls = F.cross_entropy, [0]


def poisoned(*args, **kwargs):
    loss = cross_entropy(*args, **kwargs)
    if kwargs.get("reduction", "mean") != "mean" or os.environ.get("RANK", "0") != RANK or isinstance(
            args[0], FakeTensor):  # the plan's simulated step (toolkit/plan) runs the loss on fake tensors first
        return loss
    calls[0] += 1
    return loss * float("nan") if calls[0] == STEP else loss


speaks = toolkit.errors.speaks


def speaks_late_on_rank_0(error):
    if os.environ.get("RANK", "0") == "0":
        time.sleep(1)
    return speaks(error)


F.cross_entropy = poisoned
toolkit.errors.speaks = speaks_late_on_rank_0
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
