"""Run a recipe and deliver a real SIGINT (Ctrl-C) to it at a chosen moment of optimizer step N.

    python tests/scripts/interrupt_at.py loss 12 recipes/cifar.py --dataset synthetic ...
    python tests/scripts/interrupt_at.py scheduler 12 recipes/cifar.py --dataset synthetic ...

`loss`: while step N computes its training loss (before backward and optimizer.step).
`scheduler`: when step N's learning-rate scheduler steps, i.e. after its optimizer.step() updated the weights.
The signal is sent with os.kill, so whatever SIGINT handler is in place (Python's default raises
KeyboardInterrupt) runs exactly as for a Ctrl-C arriving at that moment; nothing else in the recipe is changed.
"""

import os
import runpy
import signal
import sys

import torch
import torch.nn.functional
from torch._subclasses.fake_tensor import FakeTensor

# Ctrl-C as a terminal's foreground job gets it: a test suite run as a background job (`pytest &`) starts its
# children with SIGINT ignored, and the recipe rightly leaves an ignored SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
moment, at_step, script = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.argv = sys.argv[3:]

if moment == "loss":
    cross_entropy, training_calls = torch.nn.functional.cross_entropy, [0]

    def interrupting_cross_entropy(*args, **kwargs):
        # Evaluation runs under no_grad; the plan's simulated step (toolkit/plan) on fake tensors is not training.
        if torch.is_grad_enabled() and not isinstance(args[0], FakeTensor):
            training_calls[0] += 1
            if training_calls[0] == at_step:
                os.kill(os.getpid(), signal.SIGINT)
        return cross_entropy(*args, **kwargs)

    torch.nn.functional.cross_entropy = interrupting_cross_entropy
elif moment == "scheduler":
    step = torch.optim.lr_scheduler.LambdaLR.step

    def interrupting_step(self, *args, **kwargs):
        if self.last_epoch == at_step - 1:  # this call makes it step N (the constructor's call makes it 0)
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, *args, **kwargs)

    torch.optim.lr_scheduler.LambdaLR.step = interrupting_step
else:
    raise SystemExit(f"unknown moment {moment!r}: loss or scheduler")

sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
