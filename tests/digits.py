"""Real images with no download: scikit-learn's 1,797 handwritten-digit scans (UCI, 8x8, 17 grey levels),
upscaled to 32x32 RGB and written in CIFAR-10's pickled on-disk layout, so the recipe reads them exactly as
it reads CIFAR. An SVM reaches ~0.99 on this data; a working net should pass 0.95."""

import pickle
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

TRAIN = 1500  # the remaining 297 are the test set


def digits_as_images():
    """(uint8 N x 3 x 32 x 32 images, int labels) of every digit scan, in the bundled order."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # grey levels 0..16 -> 0..1
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False)
    x = (x * 255).round().clamp(0, 255).to(torch.uint8).repeat(1, 3, 1, 1)
    return x.numpy(), digits.target.astype(np.int64)


def write_digits_cifar(root, train=TRAIN, test=None) -> Path:
    """ROOT/cifar-10-batches-py with 5 training batches (1,500 images) and a test batch (297), split by a
    fixed permutation, or only the first `train` and `test` of each; returns ROOT (the recipe's --data-dir)."""
    images, labels = digits_as_images()
    order = np.random.default_rng(0).permutation(len(images))
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    parts = [(f"data_batch_{i}", chunk) for i, chunk in enumerate(np.array_split(order[:min(train, TRAIN)], 5), 1)]
    for name, chunk in parts + [("test_batch", order[TRAIN:][:test])]:
        with open(folder / name, "wb") as f:  # rows are channel-major: 1024 R, 1024 G, 1024 B
            pickle.dump({b"data": images[chunk].reshape(len(chunk), -1), b"labels": labels[chunk].tolist()}, f)
    return Path(root)
