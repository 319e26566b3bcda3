"""Train a small character-level GPT on a text file with the Accelerator API: the same loop as the image
recipes, with AdamW, a cosine schedule, gradient clipping and a next-token loss.

    python recipes/lm.py --epochs 2                                               # one process, the shipped text
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/lm.py     # 2 CPU processes, one gloo group
    torchrun --nproc_per_node 2 recipes/lm.py --engine ddp
    torchrun --nproc_per_node 2 recipes/lm.py --engine fsdp                       # each block sharded (FSDP2)
    toolkit launch --config_file accelerate_configs/multi_gpu.yaml recipes/lm.py --text my_corpus.txt
    toolkit launch --config_file accelerate_configs/cpu.yaml --engine fsdp --parallelism-config-tp-size 2 recipes/lm.py
    toolkit launch --config_file accelerate_configs/cpu.yaml --engine fsdp --parallelism-config-pp-size 2 recipes/lm.py

--text is any UTF-8 file (default: the Book of Genesis shipped in toolkit/data/texts/); its last 10% is the
validation text. Characters are the tokens. --global-batch-size counts sequences of --block-size characters
per optimizer step over all processes, the same under every launcher. Defaults come from the gpt-tiny preset
(toolkit/train/presets.py). Test accuracy is next-character accuracy; test loss is in nats per character.
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import toolkit
from toolkit.data.text import GENESIS, WindowLoader, load_text, window_dataset
from toolkit.models.gpt import GPT_SIZES, build_gpt
from toolkit.plan import plan_run, workloads
from toolkit.train import (EvalMetrics, TrainingConfig, TrainingRun, WeightEMA, adapt_model, apply_preset,
                           build_optimizer, check_config, decay_groups, flops_per_sample, lr_schedule, plan_batches,
                           run_guard)


@dataclass
class Config(TrainingConfig):  # the shared training flags (toolkit/train/config.py) plus this recipe's
    text: str = field(default=str(GENESIS), metadata={"help": "a UTF-8 text file; its last 10%% is validation"})
    model: str = field(default="gpt-tiny", metadata={"choices": sorted(GPT_SIZES)})
    block_size: int | None = field(default=None, metadata={"help": "characters per sequence (default: the "
                                   "model size's context)"})
    output_dir: str = field(default="runs/lm", metadata={"help": "checkpoints, metrics and summary.json"})


def next_token_loss(logits, targets):
    """Cross-entropy of each position's prediction of the next character, in nats, averaged over positions."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.no_grad()
def evaluate(model, loader, accelerator, ema=None) -> dict:
    """Accuracy and mean loss over a prepared loader: gather_for_metrics drops the samples the sampler repeated
    to even out the last batch, so every sequence counts once on any world size. With --ema-decay, the averaged
    weights' figures too, under "ema"."""
    model.eval()
    metrics = EvalMetrics()
    for inputs, targets in loader:
        metrics.update(*accelerator.gather_for_metrics((model(inputs), targets)))
    model.train()
    if ema is None:
        return metrics.compute()
    with ema.swapped():
        return {**metrics.compute(), "ema": evaluate(model, loader, accelerator)}


def main(argv=None):
    cfg, lr_rule = apply_preset(toolkit.parse_config(Config, argv, description=__doc__.splitlines()[0]))
    check_config(cfg)
    block_size = cfg.block_size or GPT_SIZES[cfg.model]["block_size"]
    accelerator = toolkit.build_accelerator(cfg.engine, mixed_precision=cfg.mixed_precision, timeout=cfg.timeout,
                                            log_with=cfg.trackers, project_dir=cfg.output_dir,
                                            checkpoint_format=cfg.checkpoint_format)
    accelerator.set_seed(cfg.seed)
    text = load_text(cfg.text)
    # toolkit plan's prediction for this run, checked after the first evaluation (--micro-batch-size auto: its pick)
    forecast = plan_run(cfg, accelerator, workloads.lm(cfg.model, text.vocab_size, block_size, cfg.optimizer))
    # Ranks that read different data: every process, but the tp ranks of a tensor-parallel mesh share one batch
    plan = plan_batches(cfg.global_batch_size, accelerator.data_parallel_size, forecast.micro_batch, forecast.said)
    accelerator.gradient_accumulation_steps = plan.accumulation
    # Training windows sharded so that every optimizer step holds the same sequences on any world size.
    train_loader = WindowLoader(text.train, block_size, plan.micro_batch, rank=accelerator.data_parallel_index,
                                world_size=accelerator.data_parallel_size, seed=cfg.seed, device=accelerator.device)
    val_loader = accelerator.prepare(DataLoader(window_dataset(text.val, block_size), plan.micro_batch))

    # --activation-checkpointing, then --compile, block by block (before prepare: fsdp then shards each block)
    model = build_gpt(cfg.model, text.vocab_size, block_size=block_size)
    flops = flops_per_sample(model, torch.zeros(1, block_size, dtype=torch.long))  # one sequence's, for MFU
    model, _ = adapt_model(model, cfg, accelerator)
    # adamw (the preset's; beta2 0.99 as nanoGPT's small character model) or sgd
    optimizer = build_optimizer(cfg.optimizer, decay_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.99))
    model, optimizer = accelerator.prepare(model, optimizer)
    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader), unit="sequences",
                      flops_per_sample=flops, forecast=forecast)
    run.config["vocabulary"] = text.chars  # saved with every checkpoint: what each output means
    # Stepped once per optimizer step below (a prepared one ticks once per process), saved with the state.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.schedule, run.total_steps, cfg.warmup))
    ema = WeightEMA(model, cfg.ema_decay, accelerator) if cfg.ema_decay else None  # --ema-decay: averaged weights
    checkpointed = [scheduler, run, *([ema] if ema else [])]  # in every save_state, in this order
    accelerator.register_for_checkpointing(*checkpointed)
    resume = run.resume_folder(model, optimizer, checkpointed)  # --resume, or a restart: start, load_state, ...
    if resume.action == "load_state":
        accelerator.load_state(resume.folder)  # weights, optimizer, schedule, every rank's RNG and the run's position
    if resume.action == "finished":  # a run that had ended: its summary.json stands, nothing is trained or rewritten
        accelerator.end_training()
        return run.finished
    accelerator.init_trackers("logs", config=asdict(cfg))  # --log-with's trackers, in OUTPUT_DIR/logs
    accelerator.print(f"{cfg.model} on {text.name}: {len(text.train)} train / {len(text.val)} val characters, "
                      f"{text.vocab_size} distinct; {block_size} per sequence; engine {accelerator.name}; global batch "
                      f"{plan}; {run.total_steps} steps; {lr_rule}; mixed precision {accelerator.mixed_precision}; "
                      f"{accelerator.threads}")
    run.divergence.started(classes=text.vocab_size)  # one line if the schedule is too short to start at full lr

    metrics, norm = None, {}
    with run_guard(run) as guard:  # Ctrl-C/SIGTERM: a checkpoint at the next step, then exit 130
        for epoch in run.epochs():
            model.train()
            for x, y in run.batches(train_loader):  # from the saved position; whole optimizer steps
                with accelerator.accumulate(model):
                    # next_token_loss(model(x), y), then backward unless --skip-nonfinite skips this step on every
                    # rank; under tp the loss runs on the vocabulary's shards (loss parallel)
                    loss = accelerator.forward_backward(model, x, y, next_token_loss, backward_if=guard.should_backward)
                    guard.check()  # every rank's loss, read once backward is queued: a NaN stops before the step
                    if accelerator.sync_gradients and cfg.clip_grad_norm:  # the whole step's gradient, once
                        norm = {"grad_norm": accelerator.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm).item()}
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:  # an optimizer step is complete
                    scheduler.step()
                    if ema:
                        ema.update()
                    accelerator.log(run.step_done(lr=scheduler.get_last_lr()[0], **norm, **guard.step_done()),
                                    step=run.step)
                    if guard.stop_requested or run.checkpoint_due():
                        run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder()))
                    guard.stop_if_asked()
            run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder()))
            if run.evaluation_due():
                metrics = evaluate(model, val_loader, accelerator, ema)
                accelerator.log(run.evaluated(metrics), step=run.step)
    summary = run.finish(metrics or evaluate(model, val_loader, accelerator, ema), vocab_size=text.vocab_size)
    accelerator.end_training()
    return summary


if __name__ == "__main__":
    main()
