"""Train any torchvision classifier on your own folder of images: the classic DDP tutorial, on every launcher.

    python recipes/images.py --data-dir data/pets --model resnet18 --image-size 224        # one process
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/images.py --data-dir data/pets
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/images.py --data-dir data/pets
    torchrun --nproc_per_node 2 recipes/images.py --data-dir data/pets --engine ddp
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml --engine ddp recipes/images.py --data-dir data/pets
    python recipes/images.py --data-dir hf:data/pets_parquet --model resnet50 --weights resnet50.pth

--data-dir holds train/<class>/* and val/<class>/* (or test/<class>/*), as torchvision's ImageFolder reads
them, or is hf:PATH (a save_to_disk folder or parquet files). Images of any size and mode are read as RGB;
class names are the folder names sorted as ImageFolder sorts them, saved in every checkpoint and in
summary.json. --model is any torchvision classification model (built with weights=None: no downloads) or
one of the toolkit's nets (tiny, resnet9, toolkit:resnet18); --weights starts from a local state dict and
gives it a new classifier head when the class count differs. DataLoader workers decode: RandomResizedCrop
and flip for training, resize and centre crop for evaluation. The global batch, presets, checkpoints with
exact mid-epoch resume, evaluation and records are cifar.py's (toolkit/train/loop.py). An unreadable image file
stops the run with its path (exit 2).
"""

from dataclasses import dataclass, field

import toolkit
from toolkit.data.memory import AUGMENTATIONS
from toolkit.data.folder import StreamingLoader, default_workers, open_images
from toolkit.train.loop import TrainingConfig, finish, fit, make_run, prepare_model_and_optimizer, start
from toolkit.train.presets import apply_preset
from toolkit.models.vision import TOOLKIT_PREFIX, build_image_model, is_torchvision_model, start_from_weights


@dataclass
class Config(TrainingConfig):  # the loop's flags (toolkit/train/loop.py) plus this recipe's data and model
    data_dir: str = field(default="data/images", metadata={"help": "ImageFolder layout (train/, val/ or test/) "
                          "or hf:PATH (save_to_disk folder or parquet files)"})
    model: str = field(default="resnet18", metadata={"help": "a torchvision classification model, or tiny, "
                       "resnet9, toolkit:resnet18 (the toolkit's nets)"})
    image_size: int = field(default=224, metadata={"help": "pixels per side the model sees"})
    weights: str | None = field(default=None, metadata={"help": "local state dict to start from (.safetensors "
                                "or a torchvision .pth); a new classifier head when the class count differs"})
    augment: str = field(default="crop-flip", metadata={"choices": list(AUGMENTATIONS),
                         "help": "RandomResizedCrop + flip, RandomResizedCrop, or resize + centre crop"})
    workers: int | None = field(default=None, metadata={"help": "decoding workers per process "
                                "(default: the cores per process, at most 8)"})
    output_dir: str = field(default="runs/images", metadata={"help": "checkpoints, metrics and summary.json"})


def preset_name(model: str) -> str:
    """torchvision's models share torchvision's reference recipe; the toolkit's nets have their own presets."""
    return "torchvision" if is_torchvision_model(model) else model.removeprefix(TOOLKIT_PREFIX)


def build_loaders(cfg, data, accelerator, micro_batch: int):
    workers = cfg.workers if cfg.workers is not None else default_workers(accelerator.env.local_world_size)
    common = dict(rank=accelerator.process_index, world_size=accelerator.num_processes, seed=cfg.seed,
                  image_size=cfg.image_size, workers=workers, device=accelerator.device)
    train = StreamingLoader(data.train, micro_batch, train=True, augment=cfg.augment, **common)
    test = StreamingLoader(data.val, micro_batch, train=False, **common)
    return train, test


def build_model(cfg, num_classes: int, accelerator):
    model = build_image_model(cfg.model, num_classes, cfg.image_size)
    if cfg.weights:
        start_from_weights(model, cfg.weights, accelerator.print)
    return model


def main(argv=None):
    cfg = toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0])
    cfg = apply_preset(cfg, preset_name(cfg.model))
    if cfg.image_size < 1 or cfg.workers is not None and cfg.workers < 0:
        raise toolkit.UserError("--image-size must be at least 1 and --workers at least 0.")
    accelerator, plan, cfg = start(cfg)
    with accelerator.main_process_first():  # one parquet cache, not one per rank
        data = open_images(cfg.data_dir, cache_dir=cfg.output_dir)
    train_loader, test_loader = build_loaders(cfg, data, accelerator, plan.micro_batch)
    model, optimizer, bn_fallback = prepare_model_and_optimizer(build_model(cfg, len(data.classes), accelerator), cfg,
                                                                accelerator)
    run = make_run(cfg, accelerator, plan, model, optimizer, len(train_loader))
    run.config["classes"] = data.classes  # saved with every checkpoint: the model's outputs, named
    accelerator.print(f"{cfg.model} at {cfg.image_size}px on {data.name}: {len(data.train)} train / {len(data.val)} "
                      f"val images, {len(data.classes)} classes; engine {accelerator.name}; global batch {plan}; "
                      f"{run.total_steps} steps; {cfg.lr_rule}; mixed precision {accelerator.mixed_precision}")
    metrics, records = fit(run, cfg, train_loader, test_loader, bn_fallback)
    return finish(run, cfg, records, metrics, dataset=data.name, classes=data.classes)


if __name__ == "__main__":
    main()
