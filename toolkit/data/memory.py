"""Image datasets held in memory as uint8 N x 3 x 32 x 32 tensors, and two loaders with the same
augmentation and normalisation: `MemoryLoader` (whole dataset on the device, world-size-independent
sharding) and `build_torch_loader` (a plain DataLoader with torchvision transforms). AUGMENTATIONS:
"crop-flip" is a random 32-crop of the 4-pixel zero-padded image, then a horizontal flip with p=0.5;
flips are wrong for digits and text, so "crop" and "none" exist.

    >>> data = make_synthetic(num_train=256, num_test=64, seed=0)
    >>> loader = MemoryLoader(data.train_x, data.train_y, 64, rank=0, world_size=2, seed=0)
    >>> loader.set_epoch(0)
    >>> x, y = next(iter(loader))
    >>> x.dtype, tuple(x.shape), y.dtype, tuple(y.shape)
    (torch.float32, (64, 3, 32, 32), torch.int64, (64,))
"""

from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from toolkit.data.dataset import ImageData
from toolkit.data.safe_pickle import load_restricted
from toolkit.engines.workers import leave_stops_to_the_trainer, stopped_at_exit
from toolkit.errors import UserError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel mean of the CIFAR-10 training set, in [0, 1]
CIFAR_STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # pixels of zero padding before the random 32x32 crop
AUGMENTATIONS = ("crop-flip", "crop", "none")

CIFAR_SPECS = {  # URL and md5 as in torchvision.datasets.CIFAR10 / CIFAR100
    "cifar10": dict(folder="cifar-10-batches-py", train=[f"data_batch_{i}" for i in range(1, 6)],
                    test=["test_batch"], label_key=b"labels", num_classes=10,
                    url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
                    md5="c58f30108f718f92721af3b95e74349a"),
    "cifar100": dict(folder="cifar-100-python", train=["train"], test=["test"], label_key=b"fine_labels",
                     num_classes=100, url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
                     md5="eb9058c3a382ffc7106e4002c42a8d85"),
}


def load_cifar(name: str, data_dir: str | Path, download: bool = True) -> ImageData:
    """Read CIFAR-10/100 from the torchvision on-disk layout under `data_dir`, downloading it if
    missing, e.g. `load_cifar("cifar10", "data")`.

    We read the pickles ourselves because torchvision.datasets.CIFAR10 md5-checks every file,
    which rejects the small folders the tests write.
    """
    if name not in CIFAR_SPECS:
        raise UserError(f"Unknown CIFAR dataset {name!r}; choose cifar10 or cifar100 with --dataset.")
    spec = CIFAR_SPECS[name]
    folder = Path(data_dir).expanduser() / spec["folder"]
    if not folder.is_dir():
        _download_cifar(name, spec, folder, download)
    train_x, train_y = _read_cifar_files(folder, spec["train"], spec["label_key"], spec["num_classes"])
    test_x, test_y = _read_cifar_files(folder, spec["test"], spec["label_key"], spec["num_classes"])
    return ImageData(train_x, train_y, test_x, test_y, spec["num_classes"], name)


def _download_cifar(name: str, spec: dict, folder: Path, download: bool) -> None:
    hint = f"put the extracted {folder.name} folder under --data-dir, or use --dataset synthetic"
    if not download:
        raise UserError(f"{name} was not found in {folder}; {hint}.")
    from torchvision.datasets.utils import download_and_extract_archive

    created = _missing_ancestors(folder.parent)
    try:
        download_and_extract_archive(spec["url"], folder.parent, md5=spec["md5"])
    except Exception as err:  # offline, proxy, bad checksum: the user's remedy is the same
        _remove_download(folder, spec["url"], created)
        raise UserError(f"{name} was not found in {folder} and downloading it failed "
                        f"({type(err).__name__}); {hint}.") from err


def _missing_ancestors(path: Path) -> list[Path]:
    """The folders of `path` that do not exist yet, deepest first: a failed download removes them."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_download(folder: Path, url: str, created: list[Path]):
    """Undo a failed download: the partial archive, a half-extracted folder and the folders it made."""
    import shutil

    archive = folder.parent / url.rsplit("/", 1)[-1]
    for partial in (archive, archive.with_name(archive.name + ".part")):
        partial.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    for path in created:  # deepest first; only when empty, so nothing of the user's goes
        try:
            path.rmdir()
        except OSError:
            break


def _read_cifar_files(folder: Path, names: list[str], label_key: bytes, num_classes: int):
    xs, ys = [], []
    for file_name in names:
        path = folder / file_name
        fix = "re-extract the official archive into --data-dir or use --dataset synthetic"
        if not path.is_file():
            raise UserError(f"{path} is missing, so {folder} is not a CIFAR folder; {fix}.")
        try:
            with open(path, "rb") as f:
                # Mirrors serve these files too, and a pickle can run code: only the globals a CIFAR batch
                # needs are allowed (toolkit/data/safe_pickle.py).
                batch = load_restricted(f, str(path))
            data, labels = np.asarray(batch[b"data"]), np.asarray(batch[label_key], dtype=np.int64)
        except UserError:
            raise
        except Exception as err:  # truncated file, wrong keys, not a pickle: all a bad file
            raise UserError(f"{path} is not a readable CIFAR batch ({type(err).__name__}); {fix}.") from err
        if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (len(data),):
            raise UserError(f"{path} holds {data.dtype} data of shape {data.shape} with {labels.size} labels "
                            f"instead of N x 3072 uint8 with N labels; {fix}.")
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise UserError(f"{path} has labels outside 0..{num_classes - 1}; {fix}.")
        xs.append(data.reshape(-1, 3, 32, 32))  # rows are channel-major: 1024 R, 1024 G, 1024 B
        ys.append(labels)
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))


def make_synthetic(num_train: int = 5000, num_test: int = 1000, num_classes: int = 10, seed: int = 0) -> ImageData:
    """Deterministic learnable images: each class is a smooth random colour pattern, each sample
    that pattern shifted by up to 8 pixels plus Gaussian noise, e.g. `make_synthetic(seed=1)`.

    Measured (2 CPU cores, ~2-5 s): `tiny` after 200 SGD steps (momentum 0.9, lr 0.02 or 0.05, batch
    32 or 64, MemoryLoader augmentation) reaches 86-97% test accuracy over seeds 0-2; chance is 10%.
    """
    g = torch.Generator().manual_seed(seed)
    # A 4x4 colour grid upsampled to 40x40 gives low-frequency prototypes: a 32x32 window anywhere
    # in them still shows the class, so shifts and crop/flip augmentation keep the label.
    grid = torch.rand(num_classes, 3, 4, 4, generator=g) * 2 - 1
    prototypes = F.interpolate(grid, size=(32 + 2 * PAD,) * 2, mode="bilinear", align_corners=False)
    train_x, train_y = _synthetic_split(prototypes, num_train, g)
    test_x, test_y = _synthetic_split(prototypes, num_test, g)
    return ImageData(train_x, train_y, test_x, test_y, num_classes, "synthetic")


def _synthetic_split(prototypes: torch.Tensor, n: int, g: torch.Generator):
    labels = torch.arange(n) % len(prototypes)  # balanced classes, in random order
    labels = labels[torch.randperm(n, generator=g)]
    dy = torch.randint(0, 2 * PAD + 1, (n,), generator=g)
    dx = torch.randint(0, 2 * PAD + 1, (n,), generator=g)
    # Each sample's class prototype cropped at (dy, dx): one indexing of a strided view holding every window.
    shifted = prototypes.unfold(2, 32, 1).unfold(3, 32, 1)[labels, :, dy, dx]
    # 128 + 30 * shifted + 70 * noise, each operation in place: the same float32 roundings, without the
    # temporaries (this runs in every process of every synthetic run).
    noisy = shifted.mul_(30).add_(128).add_(torch.randn(shifted.shape, generator=g).mul_(70))
    return noisy.round_().clamp_(0, 255).to(torch.uint8), labels


def normalize(x: torch.Tensor) -> torch.Tensor:
    """uint8 images -> float32 normalised with CIFAR_MEAN/CIFAR_STD, e.g. `normalize(data.test_x[:8])`.

    Same operations in the same order as v2.ToDtype(scale=True) + v2.Normalize, so both loaders
    give bit-identical inputs.
    """
    mean, std = _norm_constants(x.device)
    return x.to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)


@functools.cache
def _norm_constants(device: torch.device):
    """Built once per device: a fresh torch.tensor on a GPU is a host-to-device copy every batch."""
    return (torch.tensor(CIFAR_MEAN, device=device).view(-1, 1, 1),
            torch.tensor(CIFAR_STD, device=device).view(-1, 1, 1))


def augment_batch(x: torch.Tensor, generator: torch.Generator, augment: str = "crop-flip") -> torch.Tensor:
    """`augment` (one of AUGMENTATIONS) applied to a uint8 batch on x's device, e.g.
    `augment_batch(x, torch.Generator().manual_seed(0))`."""
    dy, dx, flip = _draw_augment(len(x), generator, x.device, augment)
    return _crop_flip(x, dy, dx, flip)


def _draw_augment(n: int, generator: torch.Generator, device, augment: str = "crop-flip") -> tuple[torch.Tensor, ...]:
    # Drawn on the generator's device and then moved, so a CPU generator gives the same
    # crops whether the images live on the CPU or a GPU. All three are drawn whatever `augment` says, so
    # "crop" takes exactly the crops of "crop-flip".
    if augment not in AUGMENTATIONS:
        raise UserError(f"Unknown augmentation {augment!r}; choose one of {', '.join(AUGMENTATIONS)} with --augment.")
    dy = torch.randint(0, 2 * PAD + 1, (n,), generator=generator, device=generator.device)
    dx = torch.randint(0, 2 * PAD + 1, (n,), generator=generator, device=generator.device)
    flip = torch.rand(n, generator=generator, device=generator.device) < 0.5
    if augment != "crop-flip":
        flip.zero_()
    if augment == "none":  # the unshifted window of the padded image is the image itself
        dy.fill_(PAD), dx.fill_(PAD)
    return dy.to(device), dx.to(device), flip.to(device)


def _crop_flip(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor, size: int = 32):
    """Crop each padded image at (dy, dx) and mirror it where `flip`: one indexing of a strided view that
    holds every window of the image and of its mirror, with no per-pixel index tensor (3x faster on CPU
    than building one). Cropping the mirrored image at column 2*PAD-dx is the mirror of the dx crop."""
    padded = F.pad(x, (PAD, PAD, PAD, PAD))  # zeros, as v2.RandomCrop(32, padding=4)
    windows = torch.stack([padded, padded.flip(-1)], 1).unfold(3, size, 1).unfold(4, size, 1)
    columns = torch.where(flip, 2 * PAD - dx, dx)
    return windows[torch.arange(len(x), device=x.device), flip.long(), :, dy, columns]


def mix_seed(*values: int) -> int:
    """A seed that is a pure function of `values` (seed, epoch, step), so runs are reproducible."""
    h = 0
    for v in values:
        h = (h * 1_000_003 + v) % 2**63
    return h


class MemoryLoader:
    """Batches a whole uint8 dataset held as one tensor on `device`; yields (normalised x, y).

    Train (shuffled, augmented, drop_last by default): epoch e uses the permutation seeded by
    (seed, e), the same on every rank. With W = world_size and B = batch_size, micro-step k is
    perm[k*W*B : (k+1)*W*B] and rank r takes every W-th sample of it, [r::W]. Crop/flip parameters
    are drawn once per epoch for every position of the permutation, from a generator seeded by
    (seed, e), so a sample's augmentation depends on its position in the epoch only. So the union of
    W ranks' step-k batches at batch B is exactly the step-k batch of one rank at batch W*B,
    augmentation included, and so are G consecutive micro-batches of B*W/G (gradient
    accumulation); the ranks' shards are disjoint. drop_last drops the last partial micro-step;
    without it at most W-1 samples per epoch are dropped, so all ranks see the same number of samples.

    Resume: call `set_epoch(e, start_batch=k)` with k = global samples already consumed this
    epoch // (W*B); this maps across world sizes because k indexes micro-steps of all ranks.

    Eval (train=False): no shuffle, augmentation or drop; rank r takes samples r::W, so shards
    differ in size by at most one (`num_samples` is this rank's count).

    >>> data = make_synthetic(num_train=256, num_test=99, seed=0)
    >>> whole = next(iter(MemoryLoader(data.train_x, data.train_y, 64, seed=0)))[0]
    >>> halves = [next(iter(MemoryLoader(data.train_x, data.train_y, 32, rank=r, world_size=2, seed=0)))[0]
    ...           for r in (0, 1)]
    >>> torch.equal(whole[0::2], halves[0]) and torch.equal(whole[1::2], halves[1])  # augmentation included
    True
    >>> loader = MemoryLoader(data.train_x, data.train_y, 64, rank=1, world_size=2, seed=0)
    >>> loader.set_epoch(3, start_batch=1)  # resume epoch 3 after 1 of its 2 micro-steps
    >>> [len(y) for _, y in loader], [len(y) for _, y in loader]  # the next pass starts at step 0
    ([64], [64, 64])
    >>> MemoryLoader(data.test_x, data.test_y, 64, rank=1, world_size=2, train=False).num_samples  # 1, 3, ..., 97
    49
    """

    resumes_mid_epoch = True  # toolkit.train.data_position.epoch_batches calls set_epoch(epoch, start_batch)

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, train: bool = True, device="cpu", drop_last=None,
                 augment: str = "crop-flip"):
        if images.dtype != torch.uint8 or images.ndim != 4 or len(images) != len(labels) or not 0 <= rank < world_size:
            raise ValueError(f"expected uint8 N x C x H x W images, N labels and 0 <= rank < world_size, got "
                             f"{images.dtype} {tuple(images.shape)}, {tuple(labels.shape)}, {rank}, {world_size}")
        if batch_size < 1:
            raise UserError(f"The batch size must be at least 1, not {batch_size}; fix --micro-batch-size.")
        self.images, self.labels = images.to(device), labels.to(device)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.train, self.device, self.augment = train, torch.device(device), augment
        self.drop_last = train if drop_last is None else drop_last
        self.epoch, self._start_batch = 0, 0
        n, per_micro_step = len(images), world_size * batch_size  # images of all ranks' micro-step
        if train:
            usable = n - n % world_size  # drop < W samples so every rank gets the same count
            self._batches = usable // per_micro_step if self.drop_last else math.ceil(usable / per_micro_step)
            self.samples_per_epoch = min(self._batches * per_micro_step, usable)
            self.num_samples = self.samples_per_epoch // world_size
        else:
            self._shard = torch.arange(rank, n, world_size, device=device)  # on the device: no copy per batch
            keep = lambda count: count // batch_size * batch_size if self.drop_last else count
            self.num_samples = keep(len(self._shard))
            self._batches = math.ceil(self.num_samples / batch_size)
            self.samples_per_epoch = sum(keep(len(range(r, n, world_size))) for r in range(world_size))
        if train and self._batches == 0:
            raise UserError(f"The training set has {n} samples, fewer than the {world_size} x {batch_size} of one "
                            f"micro-step over all processes; lower --global-batch-size or --micro-batch-size.")

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (it seeds shuffling and augmentation); the next iteration starts at
        micro-step `start_batch` of it, later ones at micro-step 0."""
        if not 0 <= start_batch <= self._batches:
            raise ValueError(f"start_batch {start_batch} is outside 0..{self._batches}")
        self.epoch, self._start_batch = epoch, start_batch

    def __len__(self) -> int:
        """Batches per full epoch on this rank (the same on every rank when training)."""
        return self._batches

    def __iter__(self):
        start, self._start_batch = self._start_batch, 0
        return self._train_batches(start) if self.train else self._eval_batches(start)

    def _train_batches(self, start: int):
        # The permutation is drawn on the CPU so it is identical on every device type.
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        perm = torch.randperm(len(self.images), generator=generator)
        augment = _draw_augment(len(perm), generator, self.device, self.augment)  # one per position in the epoch
        perm = perm.to(self.device)  # copied once per epoch; every step below indexes on the device
        per_micro_step = self.world_size * self.batch_size
        for micro_step in range(start, self._batches):
            # This rank's positions in the epoch order: every W-th of those of all ranks' micro-step.
            end = min((micro_step + 1) * per_micro_step, self.samples_per_epoch)
            positions = torch.arange(micro_step * per_micro_step + self.rank, end, self.world_size, device=self.device)
            idx = perm[positions]
            dy, dx, flip = (a[positions] for a in augment)
            yield normalize(_crop_flip(self.images[idx], dy, dx, flip)), self.labels[idx]

    def _eval_batches(self, start: int):
        shard = self._shard[: self.num_samples]
        for step in range(start, self._batches):
            idx = shard[step * self.batch_size:(step + 1) * self.batch_size]
            yield normalize(self.images[idx]), self.labels[idx]


class TensorImageDataset(torch.utils.data.Dataset):
    """(transform(image), label) pairs over uint8 N x 3 x H x W images and int64 labels. Sample i's random
    transform in epoch e draws from an RNG seeded by (seed, e, i) alone, so it is the same whatever the world
    size, the worker that loads it or the step a run resumed at; the loader sets e through `set_epoch` (as
    Accelerate's DataLoaderShard and the toolkit's PreparedDataLoader do)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform, seed: int = 0):
        self.images, self.labels, self.transform, self.seed = images, labels, transform, seed
        # Shared memory: persistent workers hold a copy of the dataset made at the first epoch and must
        # still see the epoch change.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        from torchvision import tv_tensors

        with sample_rng(self.seed, int(self._epoch), i):
            # Wrapping as an Image makes v2 transforms treat it as one rather than guess.
            return self.transform(tv_tensors.Image(self.images[i])).as_subclass(torch.Tensor), int(self.labels[i])


@contextlib.contextmanager
def sample_rng(seed: int, epoch: int, index: int):
    """Seed the global torch RNG from (seed, epoch, index) for one sample's transform (torchvision's v2
    transforms draw from it). A DataLoader worker's RNG is its own; in the main process (no workers) the
    previous state comes back afterwards, so dropout and the like do not see the seeding."""
    in_worker = torch.utils.data.get_worker_info() is not None
    with contextlib.nullcontext() if in_worker else torch.random.fork_rng(devices=[]):
        torch.manual_seed(mix_seed(seed, epoch, index))
        yield


def build_torch_loader(images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, train: bool,
                       seed: int, num_workers: int = 0, augment: str = "crop-flip") -> torch.utils.data.DataLoader:
    """A standard DataLoader with the same augmentation and normalisation as MemoryLoader, e.g.
    `build_torch_loader(data.train_x, data.train_y, 64, train=True, seed=0)`.

    `seed` fixes the shuffle order and, with the epoch and the sample's index, its augmentation
    (TensorImageDataset), so neither the world size, the workers nor a resume change it.
    """
    from torchvision.transforms import v2

    steps = {"crop-flip": [v2.RandomCrop(32, padding=PAD), v2.RandomHorizontalFlip()],
             "crop": [v2.RandomCrop(32, padding=PAD)], "none": []}[augment] if train else []
    transform = v2.Compose(steps + [v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR_MEAN, CIFAR_STD)])
    return stopped_at_exit(torch.utils.data.DataLoader(
        TensorImageDataset(images, labels, transform, seed), batch_size=batch_size, shuffle=train,
        drop_last=train, num_workers=num_workers, generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0, worker_init_fn=leave_stops_to_the_trainer,
    ))


