"""What every conformance script shares: the one switch between Accelerate's own Accelerator and a toolkit
engine, and the toy task they train (a small classifier on a fixed synthetic dataset).

`build_accelerator("real", **kwargs)` is `accelerate.Accelerator(**kwargs)`; any other name is
`toolkit.build_accelerator(name, **kwargs)` with the very same keywords. Nothing else in a script may ask
which one it runs under: that is the contract (docs/engines.md) these scripts check.
"""

import json
import os

import torch
from torch.utils.data import TensorDataset

import toolkit

SEED = 1234  # non-zero: a seed of 0 would hide code that forgets to pass it on
DATA_SEED = 7  # the dataset's own generator: the same samples whatever the training seed


def build_accelerator(engine: str, **kwargs):
    """Accelerate's Accelerator (engine "real") or the toolkit engine `engine`, built from the same keywords."""
    if engine != "real":
        return toolkit.build_accelerator(engine, **kwargs)
    from accelerate import Accelerator

    if kwargs.get("log_with"):
        # Accelerate itself has no jsonl/csv tracker: a plain Accelerate user registers the toolkit's with
        # accelerate.tracking.register_tracker_class, which for_accelerate does (the toolkit's accelerate
        # engine must manage without this line: it gets the keywords as they are).
        from toolkit.engines.tracking import for_accelerate

        for_accelerate(kwargs["log_with"], kwargs.get("project_dir"))
    return Accelerator(**kwargs)


def classification_data(size: int, seed: int = DATA_SEED) -> TensorDataset:
    """`size` samples (features, class in 0..2, the sample's index): the index lets a run report which
    samples each step trained on."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, 4, generator=generator)
    labels = (features[:, 0] + features[:, 1] > 0).long() + (features[:, 2] > 0.5).long()
    return TensorDataset(features, labels, torch.arange(size))


class Classifier(torch.nn.Module):
    """Two linear layers (16 and 3 rows: FSDP pads the second one's shards at 2 ranks) and a learned
    temperature, a 0-dim parameter as in Accelerate's RegressionModel (FSDP cannot shard it)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(4, 16)
        self.head = torch.nn.Linear(16, 3)
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, features):
        return self.head(torch.relu(self.hidden(features))) / self.temperature


def write_json(path, value):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as file:
        json.dump(value, file, indent=1)
