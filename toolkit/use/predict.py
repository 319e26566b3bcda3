"""`toolkit predict CHECKPOINT IMAGES...|FOLDER`: the top-k classes of each image with their probabilities (the
softmax of the logits), batched, on CPU or GPU, as CSV (path, class_1, prob_1, ...) or JSON.

    toolkit predict runs/digits/checkpoints data/digits/val --out predictions.csv
    # wrote predictions.csv: 297 images, top 5 of 10 classes
    # accuracy 0.9158 on 297 images (labels from the folder names)

Images are opened as the recipe's evaluation opens them (any mode read as RGB, one sentence naming a file that
is not a readable image) and preprocessed as it evaluated them (toolkit/use/model.py). A folder is walked
recursively for image files, in sorted order. When the one input is an ImageFolder split (every image under a
subfolder named like one of the checkpoint's classes), the top-1 accuracy is printed too: on the run's own
validation folder it is the run's test accuracy.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from toolkit.data.folder import ImageFiles
from toolkit.errors import UserError
from toolkit.use.model import TrainedModel, load_trained_model, pick_device

OUT_SUFFIXES = (".csv", ".json")


def image_paths(inputs) -> list[Path]:
    """The image files `inputs` names: a file as given, a folder walked recursively for files with an image
    extension (torchvision's list), in sorted order.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as root:
    ...     for name in ("b/2.png", "a/1.JPG", "a/notes.txt"):
    ...         (Path(root) / name).parent.mkdir(exist_ok=True)
    ...         (Path(root) / name).touch()
    ...     [p.relative_to(root).as_posix() for p in image_paths([root])]
    ['a/1.JPG', 'b/2.png']
    """
    from torchvision.datasets.folder import IMG_EXTENSIONS

    paths = []
    for given in map(Path, inputs):
        if given.is_dir():
            found = sorted(p for p in given.rglob("*") if p.suffix.lower() in IMG_EXTENSIONS and p.is_file())
            if not found:
                raise UserError(f"{given} holds no image files ({', '.join(IMG_EXTENSIONS)}).")
            paths += found
        elif given.is_file():
            paths.append(given)  # any name: a file that is not an image is refused when opened, by its path
        else:
            raise UserError(f"{given} does not exist; name image files or folders of them.")
    return paths


def folder_labels(folder: Path, paths, classes: list[str]) -> list[int] | None:
    """Each image's class index when `folder` is an ImageFolder split of `classes` (every image under
    folder/<class>/), else None.

    >>> folder_labels(Path("val"), [Path("val/dog/1.png"), Path("val/cat/x/2.png")], ["cat", "dog"])
    [1, 0]
    >>> print(folder_labels(Path("val"), [Path("val/dog/1.png"), Path("val/3.png")], ["cat", "dog"]))
    None
    """
    index = {name: i for i, name in enumerate(classes)}
    labels = []
    for path in paths:
        parts = path.relative_to(folder).parts
        if len(parts) < 2 or parts[0] not in index:
            return None
        labels.append(index[parts[0]])
    return labels


@torch.inference_mode()
def predict(trained: TrainedModel, paths, top_k: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, class indices) of the `top_k` most probable classes of each image, N x top_k each, most
    probable first, on the CPU."""
    device = next(trained.model.parameters()).device
    files = ImageFiles([str(p) for p in paths], [0] * len(paths), "the images").with_transform(trained.transform)
    probabilities, indices = [], []
    for images, _ in DataLoader(files, batch_size):  # decoded here: a bad file's sentence comes out as it is
        top = trained.model(images.to(device)).float().softmax(dim=1).topk(top_k, dim=1)
        probabilities.append(top.values.cpu())
        indices.append(top.indices.cpu())
    return torch.cat(probabilities), torch.cat(indices)


def write_predictions(stream, kind: str, paths, classes, probabilities, indices):
    """CSV: path, class_1, prob_1, ... (six decimals); JSON: a list of {"path", "top_k": [{"class",
    "probability"}, ...]}."""
    if kind == ".json":  # one image per line
        rows = [json.dumps({"path": str(path), "top_k": [{"class": classes[i], "probability": p}
                                                         for i, p in zip(ids.tolist(), probs.tolist())]})
                for path, probs, ids in zip(paths, probabilities, indices)]
        stream.write("[\n" + ",\n".join(rows) + "\n]\n")
        return
    writer = csv.writer(stream, lineterminator="\n")
    k = indices.shape[1]
    writer.writerow(["path"] + [f"{name}_{j}" for j in range(1, k + 1) for name in ("class", "prob")])
    for path, probs, ids in zip(paths, probabilities, indices):
        writer.writerow([str(path)] + [v for i, p in zip(ids.tolist(), probs.tolist())
                                       for v in (classes[i], f"{p:.6f}")])


def run_predict(args) -> int:
    """`toolkit predict CHECKPOINT IMAGES...|FOLDER [--top-k K] [--batch-size B] [--device D] [--out FILE]`."""
    kind = Path(args.out).suffix.lower() if args.out else ".csv"
    if kind not in OUT_SUFFIXES:
        raise UserError(f"--out {args.out} must end in .csv or .json.")
    if args.top_k < 1 or args.batch_size < 1:
        raise UserError("--top-k and --batch-size must be at least 1.")
    trained = load_trained_model(args.checkpoint, pick_device(args.device), average=args.average)
    paths = image_paths(args.inputs)
    top_k = min(args.top_k, len(trained.classes))
    probabilities, indices = predict(trained, paths, top_k, args.batch_size)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as stream:
            write_predictions(stream, kind, paths, trained.classes, probabilities, indices)
        print(f"wrote {args.out}: {len(paths)} images, top {top_k} of {len(trained.classes)} classes")
    else:
        write_predictions(sys.stdout, kind, paths, trained.classes, probabilities, indices)
    folder = Path(args.inputs[0])
    labels = folder_labels(folder, paths, trained.classes) if len(args.inputs) == 1 and folder.is_dir() else None
    if labels is not None:  # stdout holds the CSV when there is no --out: the accuracy goes beside it
        correct = (indices[:, 0] == torch.tensor(labels)).sum().item()
        print(f"accuracy {correct / len(labels):.4f} on {len(labels)} images (labels from the folder names)",
              file=sys.stdout if args.out else sys.stderr)
    return 0
