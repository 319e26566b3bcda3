"""Experiment tracking, as in Accelerate's examples/by_feature/tracking.py: `log_with` jsonl and csv in
`project_dir`, the run's config, the loss and learning rate every step and the evaluation every epoch.
Only how the Accelerator is built depends on --engine ("real": accelerate.Accelerator; else a toolkit
engine, same keywords).

    python tests/scripts/conformance/tracking.py --engine real --project_dir /tmp/run --output_dir /tmp/out
    torchrun --nproc_per_node 2 tests/scripts/conformance/tracking.py --engine fsdp --project_dir /tmp/run ...

The trackers write `project_dir/conformance/log.jsonl`, `log.csv` and `config.json` (the main process
alone); the final weights go to `output_dir/model.safetensors`.
"""

import argparse

import torch
import torch.nn.functional as F
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from toy_task import SEED, Classifier, build_accelerator, classification_data

CONFIG = {"lr": 0.1, "num_epochs": 2, "seed": SEED,
          "global_batch_size": 8,  # samples per optimizer step, over all processes
          "train_size": 32, "eval_size": 37}


def training_function(config, args):
    set_seed(config["seed"])
    accelerator = build_accelerator(
        args.engine, cpu=True, log_with=["jsonl", "csv"], project_dir=args.project_dir,
        # Accelerate shuffles in the toolkit engines' order (seed + epoch) only with its seedable sampler.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    batch_size = config["global_batch_size"] // accelerator.num_processes
    train_dataloader = DataLoader(classification_data(config["train_size"]), batch_size=batch_size, shuffle=True)
    eval_dataloader = DataLoader(classification_data(config["eval_size"], seed=SEED), batch_size=batch_size)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                     total_iters=len(train_dataloader) * config["num_epochs"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accelerator.init_trackers("conformance", config)

    overall_step = 0
    for epoch in range(config["num_epochs"]):
        model.train()
        for features, labels, index in train_dataloader:
            loss = F.cross_entropy(model(features), labels)
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            overall_step += 1
            accelerator.log({"loss": accelerator.reduce(loss.detach(), reduction="mean").item(),
                             "lr": lr_scheduler.get_last_lr()[0]}, step=overall_step)

        model.eval()
        correct, total = 0, 0
        for features, labels, index in eval_dataloader:
            with torch.no_grad():
                predictions = model(features).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == references).sum().item()
            total += references.numel()
        accelerator.log({"accuracy": correct / total, "epoch": epoch}, step=overall_step)

    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    accelerator.end_training()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Experiment tracking.")
    parser.add_argument("--engine", default="real", help="real (accelerate.Accelerator) or a toolkit engine")
    parser.add_argument("--project_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    return parser.parse_args(argv)


def main():
    training_function(CONFIG, parse_args())


if __name__ == "__main__":
    main()
