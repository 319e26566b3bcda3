"""Real image files with no download: scikit-learn's handwritten digits (tests/digits.py) written as PNG files
in torchvision's ImageFolder layout (train/<class>/, val/<class>/) and as parquet, in several sizes and modes,
as a user's own folder of photos would be."""

from pathlib import Path

import numpy as np
from digits import TRAIN, digits_as_images

CLASSES = [f"digit_{d}" for d in range(10)]  # ImageFolder sorts names; these sort in digit order


def _pil(image_chw, i: int):
    """Every 7th image grayscale (L), every 7th+1 RGBA, every 7th+2 palette (P), every 5th resized to 45x37:
    the modes and sizes a real folder mixes."""
    from PIL import Image

    image = Image.fromarray(np.ascontiguousarray(image_chw.transpose(1, 2, 0)))
    mode = {0: "L", 1: "RGBA", 2: "P"}.get(i % 7)
    if mode:
        image = image.convert(mode)
    if i % 5 == 0:
        image = image.resize((45, 37))
    return image


def split_order():
    images, labels = digits_as_images()
    order = np.random.default_rng(0).permutation(len(images))  # the split tests/digits.py uses
    return images, labels, order[:TRAIN], order[TRAIN:]


def write_digit_folders(root) -> Path:
    """ROOT/train/digit_<d>/<i>.png (1,500 images) and ROOT/val/digit_<d>/<i>.png (297); returns ROOT."""
    images, labels, train, val = split_order()
    for split, indices in (("train", train), ("val", val)):
        for i in indices:
            folder = Path(root) / split / CLASSES[labels[i]]
            folder.mkdir(parents=True, exist_ok=True)
            _pil(images[i], int(i)).save(folder / f"{i:04d}.png")
    return Path(root)


def write_digit_parquet(root) -> Path:
    """ROOT/train.parquet and ROOT/test.parquet with an Image column and a ClassLabel column; returns ROOT."""
    import io

    import datasets

    images, labels, train, val = split_order()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    Path(root).mkdir(parents=True, exist_ok=True)
    for split, indices in (("train", train), ("test", val)):
        rows = {"image": [], "label": []}
        for i in indices:
            buffer = io.BytesIO()
            _pil(images[i], int(i)).save(buffer, format="PNG")
            rows["image"].append({"bytes": buffer.getvalue(), "path": None})
            rows["label"].append(int(labels[i]))
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(Path(root) / f"{split}.parquet"))
    return Path(root)
