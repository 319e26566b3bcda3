"""What each recipe trains, as a plan's `Workload`: its model, one micro-batch of its inputs and targets, its loss
and its optimizer (the model's preset's unless given).

    >>> lm("gpt-tiny", vocab=65).name
    'gpt-tiny, 64 tokens, vocabulary 65'
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.plan.trace import Workload

RECIPES = ("cifar", "images", "lm")


def images(model: str, build, classes: int = 10, size: int = 32, optimizer: str | None = None) -> Workload:
    """An image classifier (recipes/cifar.py, recipes/images.py): `build()` makes the model."""
    def example(b: int):
        return torch.randn(int(b), 3, size, size), torch.randint(0, classes, (int(b),))
    return Workload(name=f"{model} at {size}px, {classes} classes", build=build, example=example,
                    loss=F.cross_entropy, optimizer=optimizer or _preset_optimizer(model), samples="images")


def next_token_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def lm(model: str, vocab: int, block_size: int | None = None, optimizer: str | None = None, build=None) -> Workload:
    """A character-level GPT (recipes/lm.py) of size `model` over `vocab` characters."""
    from toolkit.models.gpt import GPT_SIZES, build_gpt

    block = block_size or GPT_SIZES[model]["block_size"]

    def example(b: int):
        return torch.randint(0, vocab, (int(b), block)), torch.randint(0, vocab, (int(b), block))
    return Workload(name=f"{model}, {block} tokens, vocabulary {vocab}",
                    build=build or (lambda: build_gpt(model, vocab, block_size=block)), example=example,
                    loss=next_token_loss, optimizer=optimizer or _preset_optimizer(model), samples="sequences")


def for_recipe(recipe: str, model: str | None, optimizer: str | None = None, image_size: int | None = None,
               block_size: int | None = None, classes: int | None = None) -> Workload:
    """The workload `toolkit plan --recipe R --model M` names, with the recipe's own defaults."""
    if recipe == "lm":
        from toolkit.data.text import GENESIS, load_text

        return lm(model or "gpt-tiny", load_text(str(GENESIS)).vocab_size, block_size, optimizer)
    if recipe not in RECIPES:
        raise UserError(f"--recipe {recipe}: choose one of {', '.join(RECIPES)}.")
    name = model or ("resnet18" if recipe == "cifar" else "resnet50")
    size = image_size or (32 if recipe == "cifar" else 224)
    count = classes or (10 if recipe == "cifar" else 1000)
    if recipe == "cifar":
        from toolkit.models.nets import MODELS, build_model

        if name not in MODELS:
            raise UserError(f"--model {name}: recipes/cifar.py trains {', '.join(sorted(MODELS))}.")
        return images(name, lambda: build_model(name, count), count, size, optimizer)
    from toolkit.models.vision import build_image_model

    return images(name, lambda: build_image_model(name, count, size, weights=None, say=lambda line: None), count,
                  size, optimizer)


def _preset_optimizer(model: str) -> str:
    from toolkit.train.presets import PRESETS

    preset = PRESETS.get(model)
    return getattr(preset, "optimizer", None) or "adamw"
