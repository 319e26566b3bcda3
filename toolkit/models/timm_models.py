"""Any timm model by name (`--model timm:NAME`), built untrained or from its published pretrained weights found in
the local Hugging Face or torch hub cache: never a download. timm is imported only when a timm model is asked for.

    model = build_timm_model("resnet10t", num_classes=10, image_size=32)
    model = build_timm_model("resnet18.a1_in1k", 10, 32, pretrained=True, say=print)   # from ~/.cache/huggingface
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from urllib.parse import urlparse

import torch

from toolkit.errors import UserError

TIMM_PREFIX = "timm:"  # "timm:resnet18" is timm's ResNet-18, "resnet18" torchvision's


def is_timm_model(name: str) -> bool:
    return name.startswith(TIMM_PREFIX)


def build_timm_model(name: str, num_classes: int, image_size: int, pretrained: bool = False,
                     say=print) -> torch.nn.Module:
    """timm's `name` (an architecture, optionally with a pretrained tag: resnet18.a1_in1k) with num_classes outputs;
    `pretrained` loads its published weights from the local cache, a new head when the class count differs."""
    import timm

    config = _pretrained_config(name)
    kwargs = {"num_classes": num_classes}
    if config is not None and config.fixed_input_size:  # ViTs size their position embeddings at construction
        kwargs["img_size"] = image_size
    if pretrained:
        path = cached_pretrained_file(name, config)
        # timm's own loader from a local file: it drops a head of another class count and adapts the weights to
        # the model (e.g. resamples a ViT's position embeddings); a .npz of Google's needs its custom reader.
        overlay = {"file": str(path), "custom_load": config.custom_load if path.suffix == ".npz" else False}
        kwargs.update(pretrained=True, pretrained_cfg_overlay=overlay)
    try:
        model = timm.create_model(name, **kwargs)
    except TypeError:  # a fixed-size model that does not take img_size: the probe will say if the size is wrong
        kwargs.pop("img_size", None)
        model = timm.create_model(name, **kwargs)
    except RuntimeError as error:  # a file that is not this model's weights
        if not pretrained:
            raise
        raise UserError(f"{path} could not be loaded into timm:{name} ({str(error).splitlines()[0][:160]}).") from None
    if pretrained:
        head = f"new classifier head {config.classifier} ({config.num_classes} -> {num_classes} classes)" \
            if num_classes != config.num_classes else f"classifier head kept ({num_classes} classes)"
        say(f"[toolkit] --weights pretrained: timm:{name} from {path}, {head}")
    return model


def _pretrained_config(name: str):
    """timm's pretrained config of `name` (None when the architecture has none); one sentence, with close names,
    when timm knows no such model or tag."""
    import timm
    from timm.models import get_pretrained_cfg, split_model_name_tag

    architecture, tag = split_model_name_tag(name)
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models(), n=3, cutoff=0.75)
        hint = f" (close names: {', '.join(TIMM_PREFIX + c for c in close)})" if close else ""
        raise UserError(f"timm has no model {architecture!r}{hint}; see timm.list_models() for every name.")
    try:
        return get_pretrained_cfg(name)
    except RuntimeError:  # an unknown tag
        tags = timm.list_pretrained(f"{architecture}.*")
        raise UserError(f"timm has no weights {name!r}; its tags are {', '.join(tags) or 'none'}.") from None


def cached_pretrained_file(name: str, config=None) -> Path:
    """The local file of timm model `name`'s published weights: the Hugging Face cache (where timm downloads them)
    or the torch hub cache (older timm); one sentence naming where it looked and how to fetch them when absent."""
    from huggingface_hub import constants, try_to_load_from_cache

    config = config or _pretrained_config(name)
    if config is None or not (config.hf_hub_id or config.url):
        raise UserError(f"timm:{name} has no published pretrained weights; drop --weights pretrained or pass "
                        "--weights FILE.")
    looked = []
    if config.hf_hub_id:
        repo, _, revision = config.hf_hub_id.partition("@")
        # timm asks the hub for pytorch_model.bin and takes model.safetensors instead where the repository has one
        names = [config.hf_hub_filename] if config.hf_hub_filename else ["model.safetensors", "pytorch_model.bin"]
        for filename in names:
            found = try_to_load_from_cache(repo, filename, cache_dir=constants.HF_HUB_CACHE, revision=revision or None)
            if isinstance(found, str):
                return Path(found)
        looked.append(f"{repo} in the Hugging Face cache {constants.HF_HUB_CACHE}")
    if config.url:
        folder = Path(torch.hub.get_dir()) / "checkpoints"
        path = folder / os.path.basename(urlparse(config.url).path)
        if path.is_file():
            return path
        looked.append(f"{path.name} in {folder}")
    raise UserError(f"No local pretrained weights for timm:{name} (looked for {' and '.join(looked)}); on a machine "
                    f"with internet run `python -c \"import timm; timm.create_model('{name}', pretrained=True)\"` "
                    "and copy its ~/.cache/huggingface to this one (or point HF_HOME at a copy), or pass "
                    "--weights FILE.")
