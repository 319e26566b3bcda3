"""The dataset every loader takes: a train/test split of images held in memory."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageData:
    """A train/test split: images uint8 N x 3 x 32 x 32 (NCHW), labels int64 N, on the CPU."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    name: str
