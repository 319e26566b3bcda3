"""Data: datasets by name (`load_data`), in memory (`memory`: CIFAR files, synthetic, the memory loader and
the DataLoader path with the same augmentation), Hugging Face/parquet (`hf`), image folders streamed from
disk (`folder`), character-level text (`text`), and the restricted unpickler for dataset files (`safe_pickle`).

    data = load_data("cifar10", "data", seed=0)     # downloads to data/ on first use
    data.train_x.shape                              # torch.Size([50000, 3, 32, 32]), uint8
"""

from __future__ import annotations

from pathlib import Path

from toolkit.data.dataset import ImageData
from toolkit.data.memory import CIFAR_SPECS, load_cifar, make_synthetic
from toolkit.errors import UserError

DATASET_CHOICES = "cifar10, cifar100, synthetic or hf:NAME_OR_PATH"


def load_data(dataset: str, data_dir: str | Path, seed: int) -> ImageData:
    """Load `dataset` ("cifar10", "cifar100", "synthetic" or "hf:NAME_OR_PATH"); `seed` only matters for
    "synthetic".

    >>> load_data("mnist", "data", seed=0)
    Traceback (most recent call last):
    toolkit.errors.UserError: Unknown dataset 'mnist'; choose cifar10, cifar100, synthetic or hf:NAME_OR_PATH with --dataset.
    """
    if dataset in CIFAR_SPECS:
        return load_cifar(dataset, data_dir)
    if dataset == "synthetic":
        return make_synthetic(seed=seed)
    if dataset.startswith("hf:") and len(dataset) > 3:
        from toolkit.data.hf import load_hf  # imports datasets only when asked for

        return load_hf(dataset[3:], data_dir)
    raise UserError(f"Unknown dataset {dataset!r}; choose {DATASET_CHOICES} with --dataset.")


__all__ = ["DATASET_CHOICES", "ImageData", "load_data"]
