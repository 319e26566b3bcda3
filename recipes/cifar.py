"""Train a ResNet on CIFAR-10/100 with the Accelerator API: one script from one CPU to many GPUs on many nodes.

    python recipes/cifar.py --dataset synthetic --model tiny --epochs 2          # one process
    accelerate launch recipes/cifar.py                                           # accelerate's default config
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/cifar.py --dataset synthetic
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/cifar.py
    accelerate launch --config_file accelerate_configs/multi_gpu.yaml recipes/cifar.py
    accelerate launch --config_file accelerate_configs/multi_node.yaml --machine_rank R recipes/cifar.py
    torchrun --nproc_per_node 2 recipes/cifar.py --engine ddp
    torchrun --nproc_per_node 2 recipes/cifar.py --engine fsdp                   # the model sharded (FSDP2)
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/cifar.py
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml --engine ddp recipes/cifar.py
    python recipes/cifar.py --engine dp                                          # nn.DataParallel

The engine (accelerate, ddp, fsdp, dp, single) follows from the launcher; nothing below asks which one runs.
--global-batch-size is the images in one optimizer step over all processes, the same under every launcher:
global batch = processes x --micro-batch-size x gradient accumulation, the accumulation derived. Learning
rate, weight decay, warm-up, epochs and global batch default to the model's preset (toolkit/train/presets.py).
Mixed precision comes from the accelerate profile unless --mixed-precision is given.
"""

from dataclasses import dataclass, field

import toolkit
from toolkit.data import load_data
from toolkit.data.memory import AUGMENTATIONS, MemoryLoader, build_torch_loader
from toolkit.train.loop import TrainingConfig, finish, fit, make_run, prepare_model_and_optimizer, start
from toolkit.models.nets import MODELS, build_model
from toolkit.train.presets import apply_preset


@dataclass
class Config(TrainingConfig):  # the loop's flags (toolkit/train/loop.py) plus this recipe's data and model
    dataset: str = field(default="cifar10", metadata={"help": "cifar10, cifar100, synthetic or hf:NAME_OR_PATH"})
    data_dir: str = field(default="data", metadata={"help": "folder holding (or receiving) the dataset"})
    model: str = field(default="resnet18", metadata={"choices": sorted(MODELS)})
    augment: str = field(default="crop-flip", metadata={"choices": list(AUGMENTATIONS),
                         "help": "training augmentation (flips are wrong for digits and text)"})
    loader: str = field(default="memory", metadata={"choices": ["memory", "torch"]})
    output_dir: str = field(default="runs/cifar", metadata={"help": "checkpoints, metrics and summary.json"})


def build_loaders(cfg, data, accelerator, micro_batch: int):
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    # Evaluation: disjoint shards per rank, summed once at the end (exact for any world or batch size).
    test = MemoryLoader(data.test_x, data.test_y, micro_batch, rank=rank, world_size=world, train=False, device=device)
    if cfg.loader == "memory":  # the same images in every optimizer step, whatever the world size
        train = MemoryLoader(data.train_x, data.train_y, micro_batch, rank=rank, world_size=world, seed=cfg.seed,
                             device=device, augment=cfg.augment)
    else:
        train = accelerator.prepare(build_torch_loader(data.train_x, data.train_y, micro_batch, train=True,
                                                       seed=cfg.seed, augment=cfg.augment))
    return train, test


def main(argv=None):
    cfg = apply_preset(toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0]))
    accelerator, plan, cfg = start(cfg)
    with accelerator.main_process_first():  # one download, not one per rank
        data = load_data(cfg.dataset, cfg.data_dir, cfg.seed)
    train_loader, test_loader = build_loaders(cfg, data, accelerator, plan.micro_batch)
    model, optimizer, bn_fallback = prepare_model_and_optimizer(build_model(cfg.model, data.num_classes), cfg,
                                                                accelerator)
    run = make_run(cfg, accelerator, plan, model, optimizer, len(train_loader))
    accelerator.print(f"{cfg.model} on {data.name}: {len(data.train_x)} train / {len(data.test_x)} test images; "
                      f"engine {accelerator.name}; global batch {plan}; {run.total_steps} steps; {cfg.lr_rule}; "
                      f"mixed precision {accelerator.mixed_precision}")
    metrics, records = fit(run, cfg, train_loader, test_loader, bn_fallback)
    return finish(run, cfg, records, metrics)


if __name__ == "__main__":
    main()
