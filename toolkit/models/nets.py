"""Image classifiers for 32x32 inputs (N x 3 x 32 x 32, normalised floats).

Models here are plain PyTorch and know nothing about distribution: engines wrap them afterwards
(DDP, FSDP, Accelerate) in their own `prepare()`.

    >>> from toolkit.models.nets import build_model
    >>> build_model("tiny", num_classes=10)(torch.zeros(4, 3, 32, 32)).shape
    torch.Size([4, 10])
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import UserError


class BasicBlock(nn.Module):
    """The two-conv residual block of ResNet-18/34 (He et al. 2015)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            # 1x1 projection so the skip matches the new shape (option B of the paper).
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images: 3x3 stride-1 stem and no max-pool, since the ImageNet stem
    (7x7 stride 2 + pool) would shrink a CIFAR image to 8x8 before the first block."""

    _no_split_modules = ["BasicBlock"]  # transformers' convention: the blocks an FSDP profile shards one by one

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
        )
        layers, c_in = [], 64
        for c_out, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            layers += [BasicBlock(c_in, c_out, stride), BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


def _conv_bn(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())


class _Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(_conv_bn(channels, channels), _conv_bn(channels, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class _Scale(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet-18 (BasicBlock, BatchNorm) adapted to 32x32 inputs; ~11M parameters."""
    return ResNet18(num_classes)


def resnet9(num_classes: int = 10) -> nn.Module:
    """David Page's fast ResNet-9 (the DAWNBench CIFAR-10 net that airbench descends from).

    The logits are multiplied by 0.125 because the global max-pool gives large activations;
    Page found the scaled head trains stably at high learning rates.
    """
    model = nn.Sequential(
        _conv_bn(3, 64),
        _conv_bn(64, 128), nn.MaxPool2d(2), _Residual(128),
        _conv_bn(128, 256), nn.MaxPool2d(2),
        _conv_bn(256, 512), nn.MaxPool2d(2), _Residual(512),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(512, num_classes, bias=False), _Scale(0.125),
    )
    model._no_split_modules = ["_Residual"]  # as ResNet18's: the residual blocks an FSDP profile shards one by one
    return model


def tiny(num_classes: int = 10) -> nn.Module:
    """A ~12k-parameter net for CPU tests.

    No BatchNorm and no dropout on purpose: both make a step depend on how the global batch is
    split across ranks (per-rank batch statistics, per-rank RNG), and the tests compare weights
    trained with different world sizes bit for bit.
    """
    return nn.Sequential(
        # Strided convs rather than conv + max-pool: half the CPU time for the same accuracy on
        # the synthetic data.
        nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),   # 8 x 16 x 16
        nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),  # 16 x 8 x 8
        # Pooled to 8 x 8 so any image size works (an identity at 32x32); one slot, so weight names stay "5.*".
        nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten()), nn.Linear(16 * 8 * 8, num_classes),
    )


MODELS = {"resnet18": resnet18, "resnet9": resnet9, "tiny": tiny}


def build_model(name: str, num_classes: int) -> nn.Module:
    """Build a model by name, e.g. `build_model("resnet9", num_classes=100)`."""
    if name not in MODELS:
        raise UserError(f"Unknown model {name!r}; choose one of {', '.join(MODELS)} with --model.")
    return MODELS[name](num_classes=num_classes)
