"""Your own images, streamed from disk: a folder in torchvision's ImageFolder layout (`train/<class>/*`,
`val/<class>/*` or `test/<class>/*`) or a local Hugging Face dataset (`hf:PATH`, save_to_disk or parquet), of any
size and mode (L, RGBA, P, CMYK are read as RGB), decoded by DataLoader workers.

    >>> import tempfile
    >>> from PIL import Image
    >>> root = tempfile.TemporaryDirectory()                    # or "data/pets", "hf:data/pets_parquet"
    >>> for path in [f"{root.name}/{split}/{label}/{i}.png"
    ...              for split in ("train", "val") for label in ("cat", "dog") for i in range(4)]:
    ...     os.makedirs(os.path.dirname(path), exist_ok=True)
    ...     Image.new("L", (40, 30)).save(path)
    >>> data = open_images(root.name)
    >>> data.classes, len(data.train), len(data.val)
    (['cat', 'dog'], 8, 8)
    >>> train = StreamingLoader(data.train, 2, rank=0, world_size=2, seed=0, image_size=24, train=True, workers=0)
    >>> train.set_epoch(3, start_batch=1)                       # DistributedSampler.set_epoch, then skip 1 batch
    >>> [(tuple(images.shape), labels.dtype) for images, labels in train]
    [((2, 3, 24, 24), torch.int64)]
    >>> root.cleanup()

Training: RandomResizedCrop + horizontal flip (torchvision's reference recipe); evaluation: resize to 256/224 of
the size, centre crop. A sample's augmentation is seeded by (seed, epoch, index), so it does not depend on the
worker that decodes it, and a resumed epoch continues exactly. Evaluation shards are disjoint (rank r takes
r::W, no padding), so `toolkit.train.evaluation.evaluate` counts every image once under any world size.

An unreadable image file stops the run with one sentence naming it (exit 2): training on a silently shrunken
dataset is the kind of wrong nobody notices.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from toolkit.config import listing
from toolkit.data.memory import AUGMENTATIONS, sample_rng
from toolkit.engines.workers import leave_stops_to_the_trainer, stopped_at_exit
from toolkit.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # torchvision's weights expect these (references/classification)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_RESIZE = 256 / 224  # resize to this x the crop, then centre-crop: torchvision's ImageNet evaluation


class ImageFiles(Dataset):
    """(image, label) of a list of files or of a Hugging Face split; item keys are an index (evaluation) or
    (epoch, index) (training: the pair seeds that sample's augmentation)."""

    def __init__(self, source, labels: list[int], name: str, image_col: str | None = None):
        self.source, self.labels, self.name, self.image_col = source, labels, name, image_col
        self.transform, self.seed = None, 0

    def __len__(self) -> int:
        return len(self.labels)

    def with_transform(self, transform, seed: int = 0) -> "ImageFiles":
        copy = ImageFiles(self.source, self.labels, self.name, self.image_col)
        copy.transform, copy.seed = transform, seed
        return copy

    def open_rgb(self, index: int):
        from PIL import Image

        if self.image_col is not None:  # a Hugging Face split: the row decodes to a PIL image or an array
            image, where = self.source[index][self.image_col], f"row {index} of {self.name}"
            if not isinstance(image, Image.Image):
                image = Image.fromarray(torch.as_tensor(image).to(torch.uint8).numpy())
        else:
            where = self.source[index]
            try:
                with Image.open(where) as opened:
                    opened.load()
                    image = opened
            except (OSError, SyntaxError, ValueError) as error:  # PIL's ways of saying "not an image I can read"
                raise UserError(f"{where} is not a readable image ({str(error)[:100]}); remove or replace it.") from None
        if image.mode == "P" or image.mode == "LA":  # palette transparency must go through RGBA to convert cleanly
            image = image.convert("RGBA")
        return image.convert("RGB")

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        image = self.open_rgb(index)
        with sample_rng(self.seed, epoch, index):  # independent of the worker and of resuming
            return self.transform(image), self.labels[index]


@dataclass(frozen=True)
class ImageSplits:
    train: ImageFiles
    val: ImageFiles
    classes: list[str]
    name: str


def open_images(spec: str, cache_dir: str | Path = "data") -> ImageSplits:
    """An ImageFolder-layout folder, or `hf:PATH` (a save_to_disk folder or parquet files)."""
    if spec.startswith("hf:"):
        return open_hf_images(spec[3:], Path(cache_dir) / "hf_cache")
    root = Path(spec).expanduser()
    train = root / "train"
    val = next((root / name for name in ("val", "test") if (root / name).is_dir()), None)
    if not train.is_dir() or val is None:
        raise UserError(f"{root} needs train/<class>/ and val/<class>/ (or test/<class>/) folders of images, as "
                        "torchvision's ImageFolder reads them; pass that folder with --data-dir.")
    classes, train_files = _scan(train)
    val_classes, val_files = _scan(val)
    if val_classes != classes:
        raise UserError(_class_difference(train, classes, val, val_classes))
    return ImageSplits(ImageFiles([p for p, _ in train_files], [c for _, c in train_files], str(train)),
                       ImageFiles([p for p, _ in val_files], [c for _, c in val_files], str(val)), classes, str(root))


def _scan(folder: Path):
    """ImageFolder's own class discovery and file walk, so names sort and files filter exactly as it does."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    try:
        classes, class_to_idx = find_classes(str(folder))
    except FileNotFoundError:
        raise UserError(f"{folder} holds no class folders; put each class's images in {folder}/<class>/.") from None
    files = make_dataset(str(folder), class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    counts = torch.bincount(torch.tensor([c for _, c in files], dtype=torch.long), minlength=len(classes))
    empty = [classes[i] for i in range(len(classes)) if counts[i] == 0]
    if empty:
        raise UserError(f"class folder(s) [{listing(map(repr, empty))}] in {folder} hold no image files "
                        f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder.")
    return classes, files


def _class_difference(train: Path, classes: list[str], val: Path, val_classes: list[str]) -> str:
    """What one split has that the other lacks, each way (find_classes sorts names: a different list is a
    different set).

    >>> said = _class_difference(Path("d/train"), ["cat", "dog", "eel"], Path("d/val"), ["cat", "fox"])
    >>> print(said.split("; both")[0])
    d/train has 2 classes that d/val lacks (dog, eel); d/val has 1 class that d/train lacks (fox)
    """
    differences = []
    for has, lacks, only in ((train, val, sorted(set(classes) - set(val_classes))),
                             (val, train, sorted(set(val_classes) - set(classes)))):
        if only:
            differences.append(f"{has} has {len(only)} class{'es' if len(only) > 1 else ''} that {lacks} lacks "
                               f"({listing(only)})")
    return "; ".join(differences) + "; both must hold one folder per class with the same names."


def open_hf_images(spec: str, cache_dir: Path) -> ImageSplits:
    import datasets

    from toolkit.data.hf import find_columns, open_hf, pick_splits

    train, val = pick_splits(open_hf(spec, cache_dir), spec)
    image_col, label_col = find_columns(train, spec)
    feature = train.features[label_col]
    labels = {name: [int(v) for v in split[label_col]] for name, split in (("train", train), ("val", val))}
    if isinstance(feature, datasets.ClassLabel):
        classes = list(feature.names)
    else:
        classes = [str(i) for i in range(max(labels["train"] + labels["val"]) + 1)]
    for name, ys in labels.items():
        if ys and (min(ys) < 0 or max(ys) >= len(classes)):
            raise UserError(f"The {name} split of {spec} has labels outside 0..{len(classes) - 1}; fix them.")
    return ImageSplits(ImageFiles(train, labels["train"], f"{spec} train", image_col),
                       ImageFiles(val, labels["val"], f"{spec} val", image_col), classes, f"hf:{spec}")


def image_transform(size: int, train: bool, augment: str = "crop-flip"):
    """uint8 PIL image -> normalised float32 3 x size x size."""
    from torchvision.transforms import v2

    if augment not in AUGMENTATIONS:
        raise UserError(f"Unknown augmentation {augment!r}; choose one of {', '.join(AUGMENTATIONS)} with --augment.")
    if train and augment != "none":
        steps = [v2.RandomResizedCrop(size, antialias=True)] + [v2.RandomHorizontalFlip()] * (augment == "crop-flip")
    else:
        steps = [v2.Resize(round(size * EVAL_RESIZE), antialias=True), v2.CenterCrop(size)]
    return v2.Compose([v2.PILToTensor(), *steps, v2.ToDtype(torch.float32, scale=True),
                       v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


class EpochSampler(DistributedSampler):
    """DistributedSampler (shuffled, drop_last) yielding (epoch, index) keys, able to start mid-epoch."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        start, self.start = self.start, 0
        return ((self.epoch, i) for i in list(super().__iter__())[start:])


class _Shard(Dataset):
    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, indices

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, i):
        return self.dataset[self.indices[i]]


class StreamingLoader:
    """Batches decoded by DataLoader workers, moved to `device`. Train: this rank's DistributedSampler share,
    whole batches only; eval: the disjoint shard r::W, every image once."""

    resumes_mid_epoch = True  # toolkit.train.data_position.epoch_batches calls set_epoch(epoch, start_batch)

    def __init__(self, images: ImageFiles, batch_size: int, *, rank: int, world_size: int, seed: int, image_size: int,
                 train: bool, augment: str = "crop-flip", workers: int = 2, device="cpu"):
        self.batch_size, self.device = batch_size, torch.device(device)
        dataset = images.with_transform(image_transform(image_size, train, augment), seed)
        self.sampler = (EpochSampler(dataset, world_size, rank, shuffle=True, seed=seed, drop_last=True)
                        if train else None)
        if not train:
            dataset = _Shard(dataset, range(rank, len(dataset), world_size))
        self.loader = stopped_at_exit(DataLoader(
            dataset, batch_size, sampler=self.sampler, drop_last=train, num_workers=workers,
            persistent_workers=workers > 0, pin_memory=self.device.type == "cuda",
            worker_init_fn=leave_stops_to_the_trainer))
        if train and len(self.loader) == 0:
            raise UserError(f"{images.name} has {len(images)} images, fewer than the {world_size} x {batch_size} "
                            f"of one micro-step over all processes; lower --global-batch-size or --micro-batch-size.")

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_batch * self.batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        try:
            for images, labels in self.loader:
                yield images.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)
        except UserError as error:  # from a worker: torch prepends its traceback; the sentence is the last line
            raise UserError(str(error).strip().splitlines()[-1].split("UserError: ", 1)[-1]) from None


def default_workers(local_world_size: int) -> int:
    """Decoding workers per process: this machine's cores shared by its processes, at most 8."""
    return max(1, min(8, (os.cpu_count() or 1) // max(1, local_world_size) - 1))
