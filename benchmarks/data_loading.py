"""Data loading: images/s of the memory loader divided by a torch DataLoader with PIL transforms, data only.

    python benchmarks/data_loading.py                          # one core each side, 20,000 images, batch 128, ~1 min
    python benchmarks/data_loading.py --quick                  # 2,048 images, about 12 s
    python benchmarks/data_loading.py --threads 2 --workers 2  # two cores each side

The ratio is fair only with the same cores on both sides: the default gives each loader one (memory: one
torch thread; DataLoader: no worker processes, loading in this process).

Three loaders over the same uint8 CIFAR-sized images, each timed over one epoch per round (batches are
produced and dropped, no model), all with the same augmentation (random 32-crop of the 4-pixel
zero-padded image, horizontal flip p=0.5) and normalisation:
- `memory`: toolkit.data.memory.MemoryLoader, the whole dataset as one tensor, crop and flip as one batched gather;
- `torch + PIL`: the classic CIFAR pipeline: a DataLoader over a torchvision.datasets.CIFAR10-style dataset
  (an H x W x C uint8 array, a PIL image per sample) with RandomCrop(32, padding=4),
  RandomHorizontalFlip, ToTensor and Normalize;
- `torch + v2`: toolkit.data.memory.build_torch_loader, the recipe's `--loader torch` (transforms v2 on tensors).
By default the memory loader gets one thread and the DataLoaders a worker process per CPU: the
comparison is tilted towards the DataLoaders, not away from them. Target: memory / torch + PIL >= 10 on CPU (a full run exits 1 below it, --quick never does).
"""

from __future__ import annotations

import common
import torch

from toolkit.data.memory import (
    CIFAR_MEAN,
    CIFAR_STD,
    PAD,
    MemoryLoader,
    build_torch_loader,
    make_synthetic,
)
from toolkit.errors import UserError

TARGET = 10.0  # memory loader images/s over the DataLoader + PIL pipeline's, on CPU
GPU_TARGET = 100.0  # the same ratio with --device cuda (the loader resident on the GPU); not yet measured
REFERENCE = "torch + PIL"


def parse_args(argv=None):
    parser = common.build_parser("data_loading", __doc__)
    parser.add_argument("--images", type=int, default=None, help="training images (default 20000; --quick 2048)")
    parser.add_argument("--batch-size", type=int, default=128, help="images per batch (default 128, the recipe's)")
    parser.add_argument("--workers", type=int, default=0,
                        help="DataLoader worker processes (default 0: one core, as the memory loader's one thread)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the memory loader (default 1; "
                        "give the DataLoader as many --workers for a fair ratio)")
    parser.add_argument("--rounds", type=int, default=None, help="timed epochs per loader (default 7; --quick 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where batches end up (default "
                        "cpu); cuda: the memory loader lives on the GPU, the DataLoaders' batches are copied there")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda needs a visible CUDA GPU; run on a GPU machine or use --device cpu.")
    args.images = args.images or (2048 if args.quick else 20000)
    args.rounds = args.rounds or (3 if args.quick else 7)
    if min(args.batch_size, args.rounds, args.threads) < 1 or args.workers < 0 or args.images < args.batch_size:
        raise UserError(f"need --batch-size, --rounds, --threads >= 1, --workers >= 0 and --images >= --batch-size "
                        f"(got {args.images} images, batch {args.batch_size}).")
    return args


class PILImages(torch.utils.data.Dataset):
    """(transform(PIL image), label) as torchvision.datasets.CIFAR10 serves them: N x H x W x C uint8 held
    as one array, a PIL image made per sample."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform):
        self.data = images.permute(0, 2, 3, 1).contiguous().numpy()
        self.targets, self.transform = labels.tolist(), transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def pil_loader(images, labels, batch_size: int, workers: int) -> torch.utils.data.DataLoader:
    from torchvision import transforms

    transform = transforms.Compose([transforms.RandomCrop(32, padding=PAD), transforms.RandomHorizontalFlip(),
                                    transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    return torch.utils.data.DataLoader(PILImages(images, labels, transform), batch_size=batch_size, shuffle=True,
                                       drop_last=True, num_workers=workers, persistent_workers=workers > 0)


def one_epoch(loader, device="cpu"):
    """A callable that runs one epoch of `loader` (a new epoch each call), moves each batch to `device` and
    drops it; on a GPU it waits for the device at the end, so queued work is timed too."""
    epochs = iter(range(10**9))
    cuda = torch.device(device).type == "cuda"

    def run():
        if isinstance(loader, MemoryLoader):
            loader.set_epoch(next(epochs))
        for x, y in loader:
            if cuda:
                x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()

    return run


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    torch.set_num_threads(args.threads)
    data = make_synthetic(num_train=args.images, num_test=1, seed=0)
    x, y, batch = data.train_x, data.train_y, args.batch_size
    loaders = {"memory": MemoryLoader(x, y, batch, seed=0, device=args.device),
               REFERENCE: pil_loader(x, y, batch, args.workers),
               "torch + v2": build_torch_loader(x, y, batch, train=True, seed=0, num_workers=args.workers)}
    epochs = {name: one_epoch(loader, args.device) for name, loader in loaders.items()}
    for run in epochs.values():  # warm-up: starts the persistent workers, fills caches
        run()
    times = common.time_interleaved(epochs, args.rounds)
    per_epoch = len(loaders["memory"]) * batch  # every loader drops the last partial batch
    print(f"{args.images} images, batch {batch}, {args.rounds} epochs per loader, {args.workers} DataLoader workers")
    rows, ratios = [], []
    for name in loaders:
        if name != "memory":
            ratios.append(common.Ratio(f"memory / {name}", common.paired_ratio(times, "memory", over=name),
                                       (GPU_TARGET if args.device == "cuda" else TARGET) if name == REFERENCE
                                       else None, common.median_interval(times, "memory", name)))
        relative = common.paired_ratio(times, name, over=REFERENCE)
        rows.append([name, common.per_second(per_epoch, times[name]), f"{relative:.2f}"])
    notes = [
        (f"memory runs in this process on {torch.get_num_threads()} torch thread(s) (--threads); the DataLoaders "
         + (f"use {args.workers} worker process(es) (--workers), 1 thread each." if args.workers else
            "load in this process too (--workers 0).")),
        "data only, no model: the ceiling each loader puts on training speed.",
    ]
    bars = common.Bars([r[0] for r in rows], [r[1] for r in rows], "images/s (median over epochs)",
                       [f"{r[2]}x" for r in rows])
    common.publish(out, "data_loading", "Data loading: memory loader vs torch DataLoader (data only)",
                   (["loader", "images/s (median)", f"images/s relative to {REFERENCE}"], rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


if __name__ == "__main__":
    common.run_main(main)
