"""Hugging Face `datasets` as `ImageData`: a hub name, a `save_to_disk` folder, or parquet files, with the
image and label columns detected and square images of 32x32 or more brought to 32x32.

    data = load_hf("data/my_parquet_folder", data_dir="data")   # train*.parquet + test*.parquet
    data = load_hf("uoft-cs/cifar10", data_dir="data")          # from the Hub, cached in data/hf_cache
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from toolkit.data.dataset import ImageData
from toolkit.errors import UserError


def load_hf(spec: str, data_dir: str | Path) -> ImageData:
    """Load a Hugging Face image dataset from a local path or the Hub, e.g.
    `load_hf("uoft-cs/cifar10", "data")` or `load_hf("data/my_parquet_folder", "data")`.

    Needs a 'train' and a 'test' (or 'validation') split, an image column (img/image) and a label
    column (label/fine_label/labels). Hub and parquet caches go under `data_dir/hf_cache`.
    """
    import datasets

    train, test = pick_splits(open_hf(spec, Path(data_dir).expanduser() / "hf_cache"), spec)
    image_col, label_col = find_columns(train, spec)
    train_y = torch.from_numpy(np.asarray(train[label_col], dtype=np.int64))
    test_y = torch.from_numpy(np.asarray(test[label_col], dtype=np.int64))
    feature = train.features[label_col]  # a ClassLabel knows classes that may not occur in the data
    num_classes = (feature.num_classes if isinstance(feature, datasets.ClassLabel)
                   else int(torch.cat([train_y, test_y]).max()) + 1)
    for split, y in (("train", train_y), ("test", test_y)):
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise UserError(f"The {split} split of {spec} has labels outside 0..{num_classes - 1} (unlabelled "
                            "rows are often -1); drop those rows and save the dataset again.")
    train_x, test_x = _hf_images(train, image_col, spec), _hf_images(test, image_col, spec)
    return ImageData(train_x, train_y, test_x, test_y, num_classes, f"hf:{spec}")


def open_hf(spec: str, cache_dir: Path):
    import datasets

    path = Path(spec).expanduser()
    if path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json")):
        return datasets.load_from_disk(str(path))
    if path.is_dir() or path.suffix == ".parquet" and path.is_file():
        files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
        if not files:
            raise UserError(f"{path} holds neither a save_to_disk dataset nor .parquet files; "
                            "pass one of those with --dataset hf:PATH.")
        try:
            return datasets.load_dataset("parquet", data_files=_parquet_splits(files), cache_dir=str(cache_dir))
        except (datasets.exceptions.DatasetGenerationError, OSError, ValueError) as err:  # not parquet, mixed schemas
            cause = err.__cause__ or err
            raise UserError(f"{path} could not be read as a parquet dataset ({type(cause).__name__}: "
                            f"{str(cause).splitlines()[0][:200] if str(cause) else ''}); check that every file is "
                            "parquet with the same columns and types.") from err
    if path.exists():
        raise UserError(f"{path} is not a .parquet file or a dataset folder; pass one of those with --dataset hf:PATH.")
    try:
        return datasets.load_dataset(spec, cache_dir=str(cache_dir))
    except Exception as err:  # offline, unknown name, gated repo: the remedy is the same
        raise UserError(f"Could not load {spec!r} from the Hugging Face Hub ({type(err).__name__}); check the name "
                        "and network, or pass a local save_to_disk or parquet folder as --dataset hf:PATH.") from err


def _parquet_splits(files: list[Path]) -> dict[str, list[str]]:
    splits: dict[str, list[str]] = {}
    for f in files:
        name = f.name.lower()
        split = next((s for s in ("train", "test", "validation") if s[:5] in name), None)
        if split is None:
            raise UserError(f"Cannot tell the split of {f} because its name has no 'train', 'test' or 'valid'; "
                            "rename it, e.g. to train.parquet or test.parquet.")
        splits.setdefault(split, []).append(str(f))
    return splits


def pick_splits(dataset, spec: str):
    import datasets

    names = [] if isinstance(dataset, datasets.Dataset) else list(dataset.keys())
    test_name = next((s for s in ("test", "validation") if s in names), None)
    if "train" not in names or test_name is None:
        raise UserError(f"{spec} has splits {names or '(a single unsplit Dataset)'}, but training needs a 'train' "
                        "and a 'test' (or 'validation') split; save it as a DatasetDict with those splits.")
    return dataset["train"], dataset[test_name]


def find_columns(split, spec: str) -> tuple[str, str]:
    columns = split.column_names
    image_col = next((c for c in ("img", "image") if c in columns), None)
    label_col = next((c for c in ("label", "fine_label", "labels") if c in columns), None)
    if image_col is None or label_col is None:
        raise UserError(f"{spec} has columns {columns}, but needs an image column (img or image) and a label "
                        "column (label, fine_label or labels); rename them with Dataset.rename_column.")
    return image_col, label_col


def _hf_images(split, image_col: str, spec: str) -> torch.Tensor:
    import datasets

    feature = split.features[image_col]
    # Parquet written without `datasets`' metadata holds encoded images as {bytes, path} structs or raw binary.
    encoded = isinstance(feature, dict) and "bytes" in feature or getattr(feature, "dtype", None) == "binary"
    if not isinstance(feature, datasets.Image) and not encoded:
        split = split.with_format("numpy", columns=[image_col])  # array columns: skip nested Python lists
    out = np.empty((len(split), 3, 32, 32), dtype=np.uint8)
    resized = 0
    for start in range(0, len(split), 1000):  # slices decode 1000 images at a time to bound memory
        for i, image in enumerate(split[start:start + 1000][image_col]):
            out[start + i], was_resized = _to_chw_uint8(image, spec)
            resized += was_resized
    if resized:
        # The models assume 32x32; resizing silently would hide a wrong dataset choice.
        warnings.warn(f"{resized} images of {spec} were not 32x32 and were resized (bilinear) to 32x32.")
    return torch.from_numpy(out)


def _to_chw_uint8(image, spec: str) -> tuple[np.ndarray, bool]:
    from PIL import Image

    if isinstance(image, (dict, bytes, bytearray)):
        image = _decode(image, spec)
    if not isinstance(image, Image.Image):  # an array column: H x W, H x W x 3 or 3 x H x W
        arr = np.asarray(image)
        if arr.ndim == 3 and arr.shape[0] == 3 and arr.shape[-1] != 3:
            arr = arr.transpose(1, 2, 0)  # PIL expects channels last
        if not (arr.ndim == 2 or arr.ndim == 3 and arr.shape[-1] == 3):
            raise UserError(f"{spec} has an image array of shape {arr.shape}; store H x W x 3 images.")
        if arr.dtype != np.uint8:  # float images are usually in [0, 1]
            scale = 255 if arr.dtype.kind == "f" and arr.max() <= 1.0 else 1
            arr = np.clip(np.rint(arr * scale), 0, 255).astype(np.uint8)
        image = Image.fromarray(arr)
    image = image.convert("RGB")  # L, RGBA, P, CMYK...: the models take 3 channels
    width, height = image.size
    if width != height or width < 32:
        raise UserError(f"{spec} has a {width}x{height} image; the CIFAR models take 32x32 (larger square images "
                        "are resized): resize or crop the dataset's images to a square of at least 32x32.")
    resized = image.size != (32, 32)
    if resized:
        image = image.resize((32, 32), Image.BILINEAR)
    return np.asarray(image).transpose(2, 0, 1), resized


def _decode(image, spec: str):
    """An encoded image (PNG, JPEG...) from raw bytes or a {bytes, path} struct, decoded with PIL."""
    import io

    from PIL import Image

    data = image.get("bytes") if isinstance(image, dict) else image
    if data is None:
        raise UserError(f"{spec} has an image entry without bytes (path {image.get('path')!r}); store the encoded "
                        "image bytes in the parquet file.")
    try:
        decoded = Image.open(io.BytesIO(data))
        decoded.load()
    except Exception as err:  # not an image, truncated, a decompression bomb: all a bad file
        raise UserError(f"{spec} has an image that PIL cannot decode ({type(err).__name__}); "
                        "store PNG or JPEG bytes.") from err
    return decoded
