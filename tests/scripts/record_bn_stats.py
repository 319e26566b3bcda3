"""Run a recipe as `__main__` and save each rank's BatchNorm running statistics right before the toolkit
averages them (--sync-bn's CPU fallback) to $BN_STATS_PREFIX-rankR-K.pt (K: the K-th averaging), so a test
can compute the mean over ranks itself and compare it with the checkpoint the run wrote.

    BN_STATS_PREFIX=out/bn torchrun --nproc_per_node 2 tests/scripts/record_bn_stats.py recipes/cifar.py --sync-bn ...
"""

import itertools
import os
import runpy
import sys

import torch

import toolkit.train
import toolkit.train.batchnorm as batchnorm

PREFIX = os.environ["BN_STATS_PREFIX"]
average, calls = batchnorm.average_batchnorm_stats, itertools.count()


def record_then_average(model, accelerator):
    state = accelerator.unwrap_model(model).state_dict()
    stats = {name: tensor.clone() for name, tensor in state.items() if "running_" in name}
    torch.save(stats, f"{PREFIX}-rank{accelerator.process_index}-{next(calls)}.pt")
    average(model, accelerator)


# Both names, before the recipe imports one of them.
batchnorm.average_batchnorm_stats = toolkit.train.average_batchnorm_stats = record_then_average
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
