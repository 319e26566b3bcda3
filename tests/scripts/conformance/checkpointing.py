"""Mid-epoch checkpointing and resume, as in Accelerate's examples/by_feature/checkpointing.py, with
automatic checkpoint naming (`checkpoint_<i>`) and `total_limit=2`. Only how the Accelerator is built
depends on --engine ("real": accelerate.Accelerator; else a toolkit engine, same keywords).

    python tests/scripts/conformance/checkpointing.py --engine real --project_dir /tmp/run --output_dir /tmp/out
    python tests/scripts/conformance/checkpointing.py --engine single --project_dir /tmp/run --output_dir /tmp/out \
        --stop_after_step 6                                   # "interrupted" mid-epoch 1
    python tests/scripts/conformance/checkpointing.py --engine single --project_dir /tmp/run --output_dir /tmp/out2 \
        --resume_from_checkpoint                              # from the latest checkpoint_<i>
    torchrun --nproc_per_node 2 tests/scripts/conformance/checkpointing.py --engine fsdp ...

The main process writes `output_dir/results.json` (per optimizer step: the global batch's sample indices
and the loss averaged over processes; the checkpoint folders left) and the final weights
(`output_dir/model.safetensors`, by save_model).
"""

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from torch.utils.data import DataLoader

from toy_task import SEED, Classifier, build_accelerator, classification_data, write_json

CONFIG = {"lr": 0.1, "num_epochs": 3, "seed": SEED,
          "global_batch_size": 8,  # samples per optimizer step, over all processes
          "train_size": 32}  # 4 steps per epoch


class TrainingProgress:
    """Optimizer steps taken and checkpoints saved, registered for checkpointing: the folder's name does not
    say where training stood."""

    def __init__(self):
        self.step, self.saves = 0, 0

    def state_dict(self):
        return {"step": self.step, "saves": self.saves}

    def load_state_dict(self, state):
        self.step, self.saves = state["step"], state["saves"]


def training_function(config, args):
    set_seed(config["seed"])
    accelerator = build_accelerator(
        args.engine, cpu=True,
        # Accelerate shuffles in the toolkit engines' order (seed + epoch) only with its seedable sampler.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=2))
    # The global batch stays the same at any world size: each process takes its share.
    batch_size = config["global_batch_size"] // accelerator.num_processes
    train_dataloader = DataLoader(classification_data(config["train_size"]), batch_size=batch_size, shuffle=True)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    # In steps of the unprepared loader: Accelerate ticks the schedule once per process per optimizer step.
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                     total_iters=len(train_dataloader) * config["num_epochs"])
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(model, optimizer, train_dataloader,
                                                                          lr_scheduler)

    starting_epoch, resume_step = 0, 0
    if args.resume_from_checkpoint:
        accelerator.load_state()  # the latest checkpoint_<i> under project_dir/checkpoints
        accelerator.project_configuration.iteration = progress.saves  # Accelerate does not continue the count
        starting_epoch, resume_step = divmod(progress.step, len(train_dataloader))

    steps = []
    for epoch in range(starting_epoch, config["num_epochs"]):
        model.train()
        train_dataloader.set_epoch(epoch)  # a resumed process starts in a later epoch: shuffle as that epoch did
        if args.resume_from_checkpoint and epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        for features, labels, index in active_dataloader:
            loss = F.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            steps.append([progress.step, sorted(accelerator.gather(index).tolist()),
                          accelerator.reduce(loss.detach(), reduction="mean").item()])
            if progress.step % args.checkpointing_steps == 0:
                progress.saves += 1
                accelerator.save_state()
            if progress.step == args.stop_after_step:
                break
        if progress.step == args.stop_after_step:
            break

    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    if accelerator.is_main_process:
        checkpoints = sorted(os.listdir(os.path.join(args.project_dir, "checkpoints")))
        write_json(os.path.join(args.output_dir, "results.json"), {"steps": steps, "checkpoints": checkpoints})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Mid-epoch checkpointing and resume.")
    parser.add_argument("--engine", default="real", help="real (accelerate.Accelerator) or a toolkit engine")
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--checkpointing_steps", type=int, default=2)
    parser.add_argument("--stop_after_step", type=int, default=None, help="stop there, as if interrupted")
    parser.add_argument("--resume_from_checkpoint", action="store_true")
    return parser.parse_args(argv)


def main():
    training_function(CONFIG, parse_args())


if __name__ == "__main__":
    main()
