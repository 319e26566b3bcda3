"""Images/s of recipes/images.py's streaming loader against the memory loader on the same image files, data only.

    python benchmarks/folder_loading.py --data-dir DIR                  # DIR/train/<class>/*, 32 px, 2 workers
    python benchmarks/folder_loading.py --data-dir DIR --workers 4 --image-size 64

- `streaming`: toolkit.data.folder.StreamingLoader, DataLoader workers open and decode every file each epoch,
  RandomResizedCrop + flip, normalise (what recipes/images.py trains with);
- `memory`: the same files decoded once (resize + centre crop to the size) into one uint8 tensor, then
  toolkit.data.memory.MemoryLoader's batched crop + flip each epoch (what recipes/cifar.py trains with). The
  one-time decode is reported apart: it is what the memory loader pays up front, and what makes it hold
  only datasets that fit in memory at one size.
Each round times one epoch of each, alternating; the table gives the median images/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from toolkit.data.memory import MemoryLoader
from toolkit.data.folder import StreamingLoader, open_images


def decode_all(files, size: int) -> torch.Tensor:
    from torchvision.transforms import v2

    resize = v2.Compose([v2.PILToTensor(), v2.Resize(size, antialias=True), v2.CenterCrop(size)])
    return torch.stack([resize(files.open_rgb(i)) for i in range(len(files))])


def epoch_seconds(loader, epoch: int) -> float:
    loader.set_epoch(epoch)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--data-dir", required=True, help="ImageFolder layout (train/<class>/*) or hf:PATH")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="streaming loader's decoding processes")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    files = open_images(args.data_dir).train
    start = time.perf_counter()
    images = decode_all(files, args.image_size)
    decode_s = time.perf_counter() - start
    labels = torch.tensor(files.labels)
    loaders = {
        "streaming": StreamingLoader(files, args.batch_size, rank=0, world_size=1, seed=0, image_size=args.image_size,
                                     train=True, workers=args.workers),
        "memory": MemoryLoader(images, labels, args.batch_size, seed=0) if args.image_size == 32 else None,
    }
    if loaders["memory"] is None:  # MemoryLoader's crop is CIFAR's 32-crop of a 4-pixel padding
        raise SystemExit("error: the memory loader crops 32x32 images; use --image-size 32.")
    seconds = {name: [] for name in loaders}
    for epoch in range(args.rounds + 1):  # round 0 starts the workers and warms caches: not counted
        for name, loader in (loaders.items() if epoch % 2 else reversed(loaders.items())):
            elapsed = epoch_seconds(loader, epoch)
            if epoch:
                seconds[name].append(elapsed)
    n = len(loaders["memory"]) * args.batch_size
    rates = {name: n / statistics.median(s) for name, s in seconds.items()}
    print(f"{len(files)} images from {args.data_dir} at {args.image_size}px, batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch thread(s), streaming with {args.workers} worker(s)")
    for name, rate in rates.items():
        print(f"{name:>10}: {rate:10.0f} images/s")
    print(f"memory / streaming: {rates['memory'] / rates['streaming']:.1f}; the memory loader first decoded every "
          f"file once in {decode_s:.1f} s ({len(files) / decode_s:.0f} images/s)")


if __name__ == "__main__":
    main()
