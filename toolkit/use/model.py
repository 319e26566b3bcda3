"""A recipe's checkpoint as a model ready to use: its weights (full or sharded, saved by any engine) in the
architecture its state.json names, in eval mode, with its class names and the preprocessing its inputs need.

    trained = load_trained_model("runs/pets/checkpoints")       # a step-N folder, or a root (its latest)
    probabilities = trained.model(trained.transform(rgb_image)[None]).softmax(1)

recipes/images.py checkpoints name their classes and image size and are evaluated at that size (resize, centre
crop, ImageNet mean/std: toolkit.data.folder.image_transform); recipes/cifar.py checkpoints name a dataset: their
inputs are 32x32 normalised as toolkit.data.memory.normalize does, their classes are called 0..C-1, with C read
off the classifier head's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.data.folder import EVAL_RESIZE, IMAGENET_MEAN, IMAGENET_STD, image_transform
from toolkit.data.memory import CIFAR_MEAN, CIFAR_STD, normalize
from toolkit.checkpoint.files import read_state_json
from toolkit.checkpoint.folder import resolve_checkpoint
from toolkit.checkpoint.state import model_weights, registered_states
from toolkit.checkpoint.weights import load_model, strip_wrapper_prefixes
from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model
from toolkit.models.vision import build_image_model

CIFAR_SIZE = 32  # recipes/cifar.py's nets see 32x32 images


@dataclass(frozen=True)
class Preprocessing:
    """What an image goes through before the model: read as RGB, its shorter side resized to `resize`, the
    centre `crop` x `crop` kept, pixels scaled to [0, 1], then normalised per channel by `mean` and `std`."""

    resize: int
    crop: int
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def as_dict(self) -> dict:
        """The steps as a user's own code would apply them (written beside every export).

        >>> Preprocessing(37, 32, (0.5,) * 3, (0.25,) * 3).as_dict()["resize_shorter_side"]
        37
        """
        return {"read_as": "RGB", "resize_shorter_side": self.resize, "center_crop": self.crop,
                "scale": "pixels / 255", "mean": list(self.mean), "std": list(self.std), "layout": "NCHW float32"}


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint's model on its device in eval mode, its class names, and the transform of an RGB PIL image
    into its input (3 x image_size x image_size)."""

    model: torch.nn.Module
    name: str
    classes: list[str]
    image_size: int
    preprocessing: Preprocessing
    transform: Callable
    checkpoint: Path
    step: int | None


def load_trained_model(path, device="cpu", average: bool = False) -> TrainedModel:
    """The model of a recipe's checkpoint (a step-N folder, or a checkpoints root: its latest), verified, loaded
    and in eval mode on `device`; with `average`, its parameters are the run's weight average (--ema-decay).

    >>> import tempfile
    >>> from toolkit.checkpoint.functional import save_checkpoint
    >>> root = tempfile.TemporaryDirectory()
    >>> config = {"model": "toolkit:tiny", "image_size": 32, "classes": ["cat", "dog"]}
    >>> _ = save_checkpoint(root.name, 7, model=build_image_model("toolkit:tiny", 2, 32), state={"config": config})
    >>> trained = load_trained_model(root.name)
    >>> trained.classes, trained.step, trained.model.training, trained.preprocessing.resize
    (['cat', 'dog'], 7, False, 37)
    >>> root.cleanup()
    """
    folder = resolve_checkpoint(path)
    state = read_state_json(folder)
    config = state.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), str):
        raise UserError(f"Checkpoint {folder} has no model config (state.json's \"config\" naming a \"model\"), "
                        "so the model to build is unknown; use a checkpoint saved by recipes/images.py or "
                        "recipes/cifar.py.")
    if not ("classes" in config or "image_size" in config or "dataset" in config):
        raise UserError(f"Checkpoint {folder} holds {config['model']!r}, not an image classifier (its config names "
                        "neither classes and an image size nor a dataset); predict and export take checkpoints of "
                        "recipes/images.py or recipes/cifar.py.")
    weights = model_weights(folder)
    if "classes" in config or "image_size" in config:
        model, classes, size, preprocessing, transform = _image_recipe_model(folder, config)
    else:
        model, classes, size, preprocessing, transform = _cifar_recipe_model(folder, config, weights)
    if average:  # the averaged parameters over the saved ones; buffers (BatchNorm statistics) stay the model's
        weights = {**strip_wrapper_prefixes(weights, model.state_dict()), **weight_average(folder)}
    load_model(model, weights)  # wrapper prefixes (DDP, DataParallel, torch.compile) stripped; a misfit is refused
    step = state.get("step")
    return TrainedModel(model.to(device).eval(), config["model"], classes, size, preprocessing, transform, folder,
                        step if isinstance(step, int) else None)


def weight_average(folder: Path) -> dict:
    """The weight average a run with --ema-decay saved in `folder` (its registered WeightEMA: parameter name ->
    tensor); one sentence when the run kept none."""
    for state in registered_states(folder):
        if isinstance(state, dict) and {"decay", "updates", "average"} <= set(state):
            return state["average"]
    raise UserError(f"Checkpoint {folder} holds no weight average: its run was trained without --ema-decay; drop "
                    "--average to use its weights.")


def _image_recipe_model(folder: Path, config: dict):
    classes, size = config.get("classes"), config.get("image_size")
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)
            and isinstance(size, int) and not isinstance(size, bool) and size > 0):
        raise UserError(f"Checkpoint {folder} has a config without a list of class names and a positive "
                        f"image_size (it holds classes={classes!r:.80}, image_size={size!r}); it is damaged.")
    model = build_image_model(config["model"], len(classes), size)
    preprocessing = Preprocessing(round(size * EVAL_RESIZE), size, IMAGENET_MEAN, IMAGENET_STD)
    return model, list(classes), size, preprocessing, image_transform(size, train=False)


def _cifar_recipe_model(folder: Path, config: dict, weights: dict):
    name = config["model"]
    if name not in MODELS:
        raise UserError(f"Checkpoint {folder} names model {name!r}, not one of recipes/cifar.py's "
                        f"({', '.join(MODELS)}).")
    classes = [str(i) for i in range(_head_size(folder, name, weights))]
    preprocessing = Preprocessing(CIFAR_SIZE, CIFAR_SIZE, CIFAR_MEAN, CIFAR_STD)
    return build_model(name, len(classes)), classes, CIFAR_SIZE, preprocessing, _cifar_transform()


def _head_size(folder: Path, name: str, weights: dict) -> int:
    """The class count of a recipes/cifar.py checkpoint (its config names a dataset, not classes): the rows of
    the classifier weight, found as the matrix whose shape differs from a one-class build's."""
    expected = build_model(name, 1).state_dict()
    weights = strip_wrapper_prefixes(weights, expected)
    heads = [weights[k].shape[0] for k, v in expected.items()
             if v.dim() == 2 and k in weights and weights[k].dim() == 2 and weights[k].shape != v.shape]
    if len(heads) > 1:
        raise UserError(f"Checkpoint {folder} does not fit the {name} net: {len(heads)} weight matrices differ from "
                        "its shapes; is it a checkpoint of another model?")
    return heads[0] if heads else 1


def _cifar_transform():
    """RGB PIL image -> 3 x 32 x 32, normalised exactly as recipes/cifar.py normalises its uint8 batches."""
    from torchvision.transforms import v2

    to_32 = v2.Compose([v2.PILToTensor(), v2.Resize(CIFAR_SIZE, antialias=True), v2.CenterCrop(CIFAR_SIZE)])

    def transform(image):
        return normalize(to_32(image))

    return transform


def pick_device(name: str) -> torch.device:
    """--device: cpu, cuda, or auto (cuda when torch sees one).

    >>> pick_device("cpu")
    device(type='cpu')
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but torch sees no CUDA device here; use --device cpu or auto.")
    return torch.device(name)
