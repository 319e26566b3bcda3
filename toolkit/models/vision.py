"""Any torchvision classification model by name, any timm model (timm:NAME), or the toolkit's own nets, at any image
size, optionally started from a local state dict (safetensors or a torchvision .pth) with a new head for another
class count, or from the model's published weights found in the local cache (--weights pretrained).

    model = build_image_model("resnet50", num_classes=37, image_size=160, weights="resnet50-0676ba61.pth")
    # [toolkit] --weights resnet50-0676ba61.pth: new classifier head fc (1000 -> 37 classes), the rest loaded
    model = build_image_model("timm:resnet18.a1_in1k", 37, 160, weights="pretrained")   # ~/.cache/huggingface
    freeze_backbone(model)   # (11176512, 18981): parameters fixed, parameters of the head left to train

No downloads, ever: models are built untrained and weights come from files on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import torch

from toolkit.config import listing
from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model
from toolkit.models.timm_models import TIMM_PREFIX, build_timm_model, is_timm_model

TOOLKIT_PREFIX = "toolkit:"  # "toolkit:resnet18" is the toolkit's 32x32 ResNet-18, "resnet18" torchvision's
PRETRAINED = "pretrained"  # --weights pretrained: the model's published weights, from the local cache only


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


def build_image_model(name: str, num_classes: int, image_size: int, weights: str | None = None,
                      say=print) -> torch.nn.Module:
    """A classifier for num_classes classes on image_size x image_size RGB images, started from `weights` (a local
    state dict, or "pretrained": the published weights from the local cache); one sentence when the model cannot
    run at that size or the weights are not there.

    >>> build_image_model("timm:test_resnet", 10, image_size=32)(torch.zeros(2, 3, 32, 32)).shape
    torch.Size([2, 10])
    """
    own = name.removeprefix(TOOLKIT_PREFIX)
    if is_torchvision_model(name):
        from torchvision.models import get_model

        try:
            model = get_model(name, weights=None, num_classes=num_classes, **_constructor_kwargs(name, image_size))
        except (ValueError, AssertionError) as error:  # e.g. a vit patch size that does not divide the image
            raise UserError(f"{name} cannot be built for --image-size {image_size} ({str(error).splitlines()[0]}); "
                            "pick another size.") from None
    elif is_timm_model(name):
        model = build_timm_model(name.removeprefix(TIMM_PREFIX), num_classes, image_size,
                                 pretrained=weights == PRETRAINED, say=say)
    elif own in MODELS:
        model = build_model(own, num_classes)
    else:
        raise UserError(f"Unknown model {name!r}; use a torchvision classification model (resnet18, resnet50, "
                        f"efficientnet_b0, vit_b_16, ...), timm:NAME (timm:resnet10t, ...) or one of "
                        f"{', '.join(MODELS)} with --model.")
    if weights == PRETRAINED and is_torchvision_model(name):
        path = torchvision_pretrained_file(name)
        start_from_weights(model, str(path), say, origin=f"--weights pretrained: {name} from {path}")
    elif weights == PRETRAINED and not is_timm_model(name):  # timm's were loaded as they were built
        raise UserError(f"{name} has no published pretrained weights; pass --weights FILE (e.g. a run's "
                        "checkpoints/step-N/model.safetensors) instead.")
    elif weights and weights != PRETRAINED:
        start_from_weights(model, weights, say)
    _probe(model, name, image_size, num_classes)
    return model


def torchvision_pretrained_file(name: str) -> Path:
    """Where torchvision keeps `name`'s default published weights (torch.hub.get_dir()/checkpoints); one sentence
    naming the file and how to fetch it when it is not there: nothing is downloaded."""
    from torchvision.models import get_model_weights

    url = get_model_weights(name).DEFAULT.url
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    path = folder / os.path.basename(urlparse(url).path)
    if not path.is_file():
        raise UserError(f"No local pretrained weights for {name} (looked for {path.name} in {folder}); on a machine "
                        f"with internet run `python -c \"import torchvision; torchvision.models.get_model('{name}', "
                        f"weights='DEFAULT')\"` and copy ~/.cache/torch/hub/checkpoints/{path.name} "
                        f"from it into {folder} (or point TORCH_HOME at a copy), or pass --weights FILE.")
    return path


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


def start_from_weights(model: torch.nn.Module, path: str, say, origin: str | None = None) -> None:
    """Load a state dict from `path` into `model`; tensors whose shape differs from the model's (a classifier
    head for another class count) are left as initialised, which `say` reports in one line.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     torch.save(build_image_model("toolkit:tiny", 10, image_size=32).state_dict(), f"{folder}/tiny.pth")
    ...     start_from_weights(build_image_model("toolkit:tiny", 37, 32), f"{folder}/tiny.pth", print)
    ...     # doctest: +ELLIPSIS
    [toolkit] --weights .../tiny.pth: new classifier head 5 (10 -> 37 classes), the rest loaded
    """
    origin = origin or f"--weights {path}"  # what `say` calls the file
    from toolkit.checkpoint.weights import read_weights, strip_wrapper_prefixes, load_model

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
        say(f"[toolkit] {origin}: new classifier head {', '.join(heads)} ({before} -> "
            f"{expected[fresh[0]].shape[0]} classes), the rest loaded")
    else:
        say(f"[toolkit] {origin}: all {len(expected)} tensors loaded")


def head_parameter_names(model: torch.nn.Module) -> set[str]:
    """The names (as model.named_parameters() gives them, wrapped or not) of the classifier head's parameters: timm's
    get_classifier(), else the last Linear or convolution registered (torchvision's fc, classifier.N, heads.head;
    the toolkit's nets' last layer). The layer --freeze-backbone leaves to train and --head-lr applies to.

    >>> sorted(head_parameter_names(build_image_model("toolkit:tiny", 10, 32)))
    ['5.bias', '5.weight']
    """
    from toolkit.checkpoint.weights import unwrap_model

    bare = unwrap_model(model)
    if hasattr(bare, "get_classifier"):  # timm: a module, or a tuple of them (a distilled ViT's two heads)
        heads = bare.get_classifier()
        heads = heads if isinstance(heads, (tuple, list)) else (heads,)
    else:
        layers = [m for m in bare.modules() if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))]
        heads = layers[-1:]
    owned = {id(p) for head in heads for p in head.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in owned}


def freeze_backbone(model: torch.nn.Module) -> tuple[int, int]:
    """Fix every parameter outside the classifier head (requires_grad=False); returns the numbers of parameter
    elements (frozen, trainable). BatchNorm statistics still follow the data in train mode, as in timm's and
    Accelerate's fine-tuning examples.

    >>> freeze_backbone(build_image_model("toolkit:tiny", 10, 32))
    (1392, 10250)
    """
    head = head_parameter_names(model)
    if not head:
        raise UserError(f"--freeze-backbone: {type(model).__name__} has no classifier head with parameters to train; "
                        "drop --freeze-backbone.")
    frozen = trainable = 0
    for name, parameter in model.named_parameters():
        if name in head:
            trainable += parameter.numel()
        else:
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen, trainable
