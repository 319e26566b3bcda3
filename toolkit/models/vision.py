"""Any torchvision classification model by name, or the toolkit's own nets, at any image size, optionally
started from a local state dict (safetensors or a torchvision .pth) with a new head for another class count.

    model = build_image_model("resnet50", num_classes=37, image_size=160)
    start_from_weights(model, "resnet50-0676ba61.pth", print)   # torchvision's ImageNet file, downloaded by you
    # [toolkit] --weights resnet50-0676ba61.pth: new classifier head fc (1000 -> 37 classes), the rest loaded

No hub downloads: torchvision models are built with weights=None; --weights names a file on disk.
"""

from __future__ import annotations

import torch

from toolkit.config import listing
from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model

TOOLKIT_PREFIX = "toolkit:"  # "toolkit:resnet18" is the toolkit's 32x32 ResNet-18, "resnet18" torchvision's


def torchvision_models() -> list[str]:
    from torchvision import models

    return models.list_models(module=models)  # classification only (not detection, segmentation, video)


def is_torchvision_model(name: str) -> bool:
    return name in torchvision_models()


def _constructor_kwargs(name: str, image_size: int) -> dict:
    if name.startswith("vit_"):  # positional embeddings are sized from image_size at construction
        return {"image_size": image_size}
    if name.startswith("maxvit"):
        return {"input_size": (image_size, image_size)}
    if name in ("inception_v3", "googlenet"):  # auxiliary heads make training return a tuple, not logits
        return {"aux_logits": False, "init_weights": True}
    return {}


def build_image_model(name: str, num_classes: int, image_size: int) -> torch.nn.Module:
    """A classifier for num_classes classes on image_size x image_size RGB images; one sentence when the
    model cannot run at that size."""
    own = name.removeprefix(TOOLKIT_PREFIX)
    if is_torchvision_model(name):
        from torchvision.models import get_model

        try:
            model = get_model(name, weights=None, num_classes=num_classes, **_constructor_kwargs(name, image_size))
        except (ValueError, AssertionError) as error:  # e.g. a vit patch size that does not divide the image
            raise UserError(f"{name} cannot be built for --image-size {image_size} ({str(error).splitlines()[0]}); "
                            "pick another size.") from None
    elif own in MODELS:
        model = build_model(own, num_classes)
    else:
        raise UserError(f"Unknown model {name!r}; use a torchvision classification model (resnet18, resnet50, "
                        f"efficientnet_b0, vit_b_16, ...) or one of {', '.join(MODELS)} with --model.")
    _probe(model, name, image_size, num_classes)
    return model


@torch.no_grad()
def _probe(model, name: str, image_size: int, num_classes: int):
    # One forward now rather than a shape error after the data has loaded (e.g. a net that pools 32x).
    model.eval()
    try:
        out = model(torch.zeros(1, 3, image_size, image_size))
    except RuntimeError as error:
        raise UserError(f"{name} does not run on {image_size}x{image_size} images ({str(error).splitlines()[0][:120]}); "
                        "pick a larger --image-size.") from None
    finally:
        model.train()
    if out.shape != (1, num_classes):
        raise UserError(f"{name} gives outputs of shape {tuple(out.shape)} on one image, not (1, {num_classes}).")


def start_from_weights(model: torch.nn.Module, path: str, say) -> None:
    """Load a state dict from `path` into `model`; tensors whose shape differs from the model's (a classifier
    head for another class count) are left as initialised, which `say` reports in one line.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     torch.save(build_image_model("toolkit:tiny", 10, image_size=32).state_dict(), f"{folder}/tiny.pth")
    ...     start_from_weights(build_image_model("toolkit:tiny", 37, 32), f"{folder}/tiny.pth", print)
    ...     # doctest: +ELLIPSIS
    [toolkit] --weights .../tiny.pth: new classifier head 5 (10 -> 37 classes), the rest loaded
    """
    from toolkit.engines.weights import read_weights, strip_wrapper_prefixes, load_model

    expected = model.state_dict()
    weights = strip_wrapper_prefixes(read_weights(path), expected)
    fresh = [k for k, v in weights.items() if k in expected and v.shape != expected[k].shape]
    heads = sorted({k.rsplit(".", 1)[0] for k in fresh})
    if fresh and len(heads) > 2:  # more than one head layer differs: the file is another architecture
        raise UserError(f"{path} does not fit this model: {len(fresh)} tensors have other shapes "
                        f"({listing(fresh, 3)}); is it a checkpoint of another model?")
    load_model(model, {k: v for k, v in weights.items() if k not in fresh}, strict=False)
    missing = [k for k in expected if k not in weights]
    if missing:
        raise UserError(f"{path} lacks {len(missing)} of this model's tensors ({listing(missing, 3)}); "
                        "is it a checkpoint of another model?")
    if fresh:
        before = weights[fresh[0]].shape[0]
        say(f"[toolkit] --weights {path}: new classifier head {', '.join(heads)} ({before} -> "
            f"{expected[fresh[0]].shape[0]} classes), the rest loaded")
    else:
        say(f"[toolkit] --weights {path}: all {len(expected)} tensors loaded")
