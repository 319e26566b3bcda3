"""The parts a recipe's training loop calls: the shared flags (`config`), the global batch split over processes
(`batching`), per-model hyperparameters (`presets`), parameter groups and schedules (`optim`), where a run
stands and what it records (`run`, `records`), what stops it cleanly (`guard`), exact evaluation
(`evaluation`), BatchNorm across ranks (`batchnorm`), mid-epoch resume (`data_position`) and checkpoints.
"""

from toolkit.train.batching import BatchPlan, plan_batches
from toolkit.train.batchnorm import adapt_model, average_batchnorm_stats, sync_batchnorm
from toolkit.train.config import TrainingConfig, check_config
from toolkit.train.cost import flops_per_sample
from toolkit.train.ema import WeightEMA
from toolkit.train.evaluation import EvalMetrics
from toolkit.train.guard import run_guard
from toolkit.train.optim import build_optimizer, decay_groups, lr_schedule, warmup_cosine, warmup_linear_decay
from toolkit.train.presets import apply_preset
from toolkit.train.run import TrainingRun

__all__ = ["BatchPlan", "TrainingConfig", "TrainingRun", "WeightEMA", "adapt_model", "apply_preset", "average_batchnorm_stats", "check_config",
           "build_optimizer", "decay_groups", "EvalMetrics", "flops_per_sample", "lr_schedule", "plan_batches", "run_guard", "sync_batchnorm", "warmup_cosine",
           "warmup_linear_decay"]
