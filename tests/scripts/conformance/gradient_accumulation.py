"""Gradient accumulation with clipping and an exact evaluation, as in Accelerate's
examples/by_feature/gradient_accumulation.py. Only how the Accelerator is built depends on --engine
("real": accelerate.Accelerator; else a toolkit engine, same keywords).

    python tests/scripts/conformance/gradient_accumulation.py --engine real --output_dir /tmp/out
    torchrun --nproc_per_node 2 tests/scripts/conformance/gradient_accumulation.py --engine ddp --output_dir /tmp/out

5 batches an epoch with 2 accumulated per step: the epoch's last batch is a step of its own (Accelerate
syncs at the end of the loader). The evaluation set (37 samples) does not divide by the batch: the
samples the sampler repeats to even out the processes must not count. The main process writes
`output_dir/results.json` (per batch: whether it synced, the loss averaged over processes, the
gradient norm before clipping, the learning rate; the evaluation) and `output_dir/model.safetensors`.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader

from toy_task import SEED, Classifier, build_accelerator, classification_data, write_json

CONFIG = {"lr": 0.2, "num_epochs": 2, "seed": SEED, "gradient_accumulation_steps": 2,
          "global_batch_size": 8,  # samples per forward over all processes; an optimizer step sees 2 of them
          "max_grad_norm": 0.5,  # below the first steps' norms: the clip cuts
          "train_size": 40, "eval_size": 37}


def training_function(config, args):
    set_seed(config["seed"])
    accelerator = build_accelerator(
        args.engine, cpu=True, gradient_accumulation_steps=config["gradient_accumulation_steps"],
        # Accelerate shuffles in the toolkit engines' order (seed + epoch) only with its seedable sampler.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    batch_size = config["global_batch_size"] // accelerator.num_processes
    train_dataloader = DataLoader(classification_data(config["train_size"]), batch_size=batch_size, shuffle=True)
    eval_dataloader = DataLoader(classification_data(config["eval_size"], seed=SEED), batch_size=batch_size)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=1.0, end_factor=0.1,
        total_iters=len(train_dataloader) * config["num_epochs"] // config["gradient_accumulation_steps"])
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)

    batches, evaluations = [], []
    for epoch in range(config["num_epochs"]):
        model.train()
        for features, labels, index in train_dataloader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(features), labels)
                accelerator.backward(loss)
                norm = None
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), config["max_grad_norm"]).item()
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            batches.append({"sync": accelerator.sync_gradients, "norm": norm, "lr": lr_scheduler.get_last_lr()[0],
                            "loss": accelerator.reduce(loss.detach(), reduction="mean").item()})

        model.eval()
        correct, total, loss_sum = 0, 0, 0.0
        for features, labels, index in eval_dataloader:
            with torch.no_grad():
                logits = model(features)
            losses = F.cross_entropy(logits, labels, reduction="none")
            predictions, references, losses = accelerator.gather_for_metrics((logits.argmax(-1), labels, losses))
            correct += (predictions == references).sum().item()
            total += references.numel()
            loss_sum += losses.sum().item()
        evaluations.append({"epoch": epoch, "accuracy": correct / total, "loss": loss_sum / total, "count": total})
        accelerator.print(f"epoch {epoch}: accuracy {correct / total:.3f}")

    accelerator.wait_for_everyone()
    accelerator.save_model(model, args.output_dir)
    if accelerator.is_main_process:
        write_json(os.path.join(args.output_dir, "results.json"), {"batches": batches, "evaluations": evaluations})


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Gradient accumulation with clipping.")
    parser.add_argument("--engine", default="real", help="real (accelerate.Accelerator) or a toolkit engine")
    parser.add_argument("--output_dir", required=True)
    return parser.parse_args(argv)


def main():
    training_function(CONFIG, parse_args())


if __name__ == "__main__":
    main()
