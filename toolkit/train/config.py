"""The flags every training recipe shares, declared once: the parts in toolkit/train read these names, and a
recipe's own `Config(TrainingConfig)` adds its data and model flags and its defaults.

`None` means "the preset's" (toolkit/train/presets.py fills it, each value with its source).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.files import CHECKPOINT_FORMATS
from toolkit.config import config_text, config_values
from toolkit.engines import ENGINES
from toolkit.errors import UserError
from toolkit.launch.env import read_launch_env

OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("linear", "cosine", "constant")


@dataclass
class TrainingConfig:
    model: str = field(default="tiny", metadata={"help": "the model to train (the recipe lists its models)"})
    output_dir: str = field(default="runs/train", metadata={"help": "checkpoints, metrics and summary.json"})
    global_batch_size: int | None = field(default=None, metadata={"help": "samples per optimizer step, all processes; "
                                          "from the preset"})
    micro_batch_size: int | str | None = field(default=None, metadata={
        "type": lambda text: "auto" if text == "auto" else int(text), "metavar": "N|auto",
        "help": "samples per process per forward (caps memory; default: global batch / processes); auto: the "
                "largest the plan predicts fits the device (toolkit plan)"})
    memory: float | None = field(default=None, metadata={"metavar": "GIB", "help": "memory one process may hold, "
                                 "for --micro-batch-size auto (default: the GPU's, or the machine's shared)"})
    lr: float | None = field(default=None, metadata={"help": "peak learning rate; default: the preset's, scaled "
                             "linearly with the global batch"})
    weight_decay: float | None = field(default=None, metadata={"help": "decoupled from biases and norms; from the preset"})
    warmup: float | None = field(default=None, metadata={"help": "fraction of steps warming up; from the preset"})
    label_smoothing: float | None = field(default=None, metadata={"help": "cross-entropy label smoothing; from the preset"})
    epochs: int | None = field(default=None, metadata={"help": "passes over the training set; from the preset"})
    max_steps: int | None = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    optimizer: str | None = field(default=None, metadata={"choices": list(OPTIMIZERS), "help": "sgd (Nesterov "
                                  "momentum 0.9) or adamw (decoupled weight decay); from the preset"})
    schedule: str | None = field(default=None, metadata={"choices": list(SCHEDULES), "help": "the lr after warm-up: "
                                 "linear or cosine decay, or constant; from the preset"})
    clip_grad_norm: float | None = field(default=None, metadata={"help": "clip the global gradient norm to this once "
                                         "per optimizer step (after unscaling under fp16; the norm before clipping "
                                         "is logged as grad_norm); default: the preset's (none for images)"})
    ema_decay: float | None = field(default=None, metadata={"help": "keep an exponential moving average of the "
                                    "weights, updated once per optimizer step, evaluated and saved beside them "
                                    "(e.g. 0.999); default: none"})
    activation_checkpointing: bool = field(default=False, metadata={"help": "recompute each block's activations in "
                                           "backward instead of keeping them (less memory, ~1/3 more compute)"})
    keep_best: str | None = field(default=None, metadata={"choices": ["test_accuracy", "test_loss"], "help": "also "
                                  "keep the checkpoint with the best value of this metric (beside the last --keep); "
                                  "default: none"})
    sync_bn: bool = field(default=False, metadata={"help": "synchronise BatchNorm statistics across ranks"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    channels_last: bool = field(default=False, metadata={"help": "NHWC memory format (faster on tensor cores)"})
    checkpoint_every: int = field(default=0, metadata={"help": "optimizer steps between checkpoints (0: epochs)"})
    keep: int = field(default=3, metadata={"help": "checkpoints kept"})
    checkpoint_format: str | None = field(default=None, metadata={"choices": list(CHECKPOINT_FORMATS), "help": "full: "
                                          "weights gathered into one safetensors file; sharded: each rank writes its "
                                          "own shards (torch.distributed.checkpoint), resumable at any world size "
                                          "(default: the engine's, full unless an FSDP profile or a pipeline shards)"})
    resume: str | None = field(default=None, metadata={"help": "auto (latest in output-dir) or a checkpoint path"})
    allow_config_change: bool = field(default=False, metadata={"help": "resume with values that change the training "
                                      "(schedule, lr, global batch, precision, seed, data); refused without it"})
    seed: int = field(default=0, metadata={"help": "seeds weights, data order and augmentation"})
    eval_every: int = field(default=1, metadata={"help": "epochs between evaluations"})
    engine: str = field(default="auto", metadata={"choices": ["auto", *ENGINES]})
    mixed_precision: str | None = field(default=None, metadata={"choices": ["no", "bf16", "fp16"]})
    timeout: float = field(default=300.0, metadata={"help": "seconds a collective waits for a silent peer"})
    log_with: str | None = field(default=None, metadata={"help": "experiment trackers, comma-separated: tensorboard, "
                                 "trackio, jsonl, csv or all (written to OUTPUT_DIR/logs by the main process)"})
    peak_tflops: float | None = field(default=None, metadata={"help": "the peak TFLOP/s of one device, for MFU "
                                      "(default: a table of known GPUs; unknown on a CPU)"})
    profile_steps: str | None = field(default=None, metadata={"metavar": "A:B", "help": "run torch.profiler over "
                                      "optimizer steps A to B on every rank: a trace per rank in OUTPUT_DIR/profile "
                                      "and the top-10 ops in the log; default: none"})
    skip_nonfinite: bool = field(default=False, metadata={"help": "skip steps whose loss is NaN/inf, not stop"})
    # --print-config's format (toolkit.parse_config sets it): check_config prints the resolved settings and exits.
    print_config: str | None = field(default=None, metadata={"flag": False})

    @property
    def trackers(self) -> list[str] | None:
        """--log-with as the list `build_accelerator(log_with=...)` takes."""
        return [name.strip() for name in self.log_with.split(",")] if self.log_with else None


def check_config(cfg: TrainingConfig) -> TrainingConfig:
    """`cfg` if its values can train (after presets filled it); else one sentence naming the flag."""
    for name in ("epochs", "keep", "eval_every"):
        if getattr(cfg, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, not {getattr(cfg, name)}.")
    if cfg.max_steps is not None and cfg.max_steps < 1 or cfg.checkpoint_every < 0 or cfg.lr <= 0 or cfg.timeout <= 0:
        raise UserError("--max-steps must be at least 1, --checkpoint-every at least 0, --lr and --timeout positive.")
    if cfg.weight_decay < 0 or not 0 <= cfg.warmup < 1 or not 0 <= cfg.label_smoothing < 1:
        raise UserError("--weight-decay must be at least 0, --warmup and --label-smoothing in [0, 1).")
    if cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0:
        raise UserError(f"--clip-grad-norm must be positive, not {cfg.clip_grad_norm}.")
    if cfg.ema_decay is not None and not 0 < cfg.ema_decay < 1:
        raise UserError(f"--ema-decay must be in (0, 1), such as 0.999, not {cfg.ema_decay}.")
    if cfg.profile_steps is not None:
        from toolkit.train.profiling import parse_steps

        parse_steps(cfg.profile_steps)
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).exists():
        raise UserError(f"--resume {cfg.resume}: that path does not exist; pass a checkpoint folder or 'auto'.")
    if cfg.print_config:  # --print-config: the settings as the presets filled them, once, in a file --config reads
        if read_launch_env().rank == 0:
            print(config_text(config_values(cfg), cfg.print_config), end="")
        raise SystemExit(0)
    return cfg
