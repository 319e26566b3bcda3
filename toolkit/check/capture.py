"""What `toolkit parity` records inside the script it runs, through the engine, without the script knowing.

`toolkit parity` starts each run with two environment variables: TOOLKIT_PARITY_DIR (a folder) and
TOOLKIT_PARITY_STEPS (K). Every engine then gets a `ParityRecorder` as an observer (toolkit/__init__.py
registers `build_recorder` with toolkit/engines/observers.py), which
- in `backward(loss)` records the loss averaged over ranks (one small all-reduce), averaged again over
  the micro-steps of an accumulated optimizer step;
- at the first training-mode forward notes what can make two setups differ legitimately: the batch
  each forward sees, BatchNorm and dropout layers in train mode;
- after the K-th real optimizer step (a post-hook on the script's own optimizer, so accumulation
  micro-steps and skipped steps do not count) saves the unwrapped models' weights on the main process,
  then stops every rank cleanly: barrier, `end_training()`, exit code 0.

Without TOOLKIT_PARITY_DIR an engine gets no recorder.

>>> build_recorder(engine=None, environ={}) is None
True
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from toolkit.errors import UserError

PARITY_DIR = "TOOLKIT_PARITY_DIR"
PARITY_STEPS = "TOOLKIT_PARITY_STEPS"
RECORD_FILE = "record.json"  # losses and setup, rewritten after every optimizer step
MODEL_FILE = "model-{index}.safetensors"  # the weights of each prepared model after step K


@dataclass(frozen=True)
class ParityRequest:
    directory: str
    steps: int


def read_parity_request(environ: Mapping[str, str] | None = None) -> ParityRequest | None:
    """The one place that reads TOOLKIT_PARITY_DIR/STEPS (None when `toolkit parity` did not start us).

    >>> read_parity_request({"TOOLKIT_PARITY_DIR": "/tmp/p", "TOOLKIT_PARITY_STEPS": "3"}).steps
    3
    """
    environ = os.environ if environ is None else environ
    directory = environ.get(PARITY_DIR)
    if not directory:
        return None
    steps = environ.get(PARITY_STEPS, "")
    if not steps.isdigit() or int(steps) < 1:
        raise UserError(f"{PARITY_STEPS}={steps!r} must be a whole number of optimizer steps, at least 1.")
    return ParityRequest(directory, int(steps))


class ParityStop(SystemExit):
    """Ends the script on every rank after step K with exit code 0 (a SystemExit passes `except Exception`)."""

    def __init__(self):
        super().__init__(0)


def build_recorder(engine, environ: Mapping[str, str] | None = None) -> ParityRecorder | None:
    """The engine's recorder when `toolkit parity` started this process, else None."""
    request = read_parity_request(environ)
    return None if request is None else ParityRecorder(engine, request)


def _raw_optimizer(optimizer):
    """The user's torch optimizer inside the engine's wrapper (PreparedOptimizer, AcceleratedOptimizer)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def describe_layers(module: torch.nn.Module) -> dict:
    """Layers in train mode whose result depends on how the batch is split or on per-rank RNG."""
    bn = torch.nn.modules.batchnorm._BatchNorm
    layers = [m for m in module.modules() if m.training]
    return {
        "batchnorm": sum(isinstance(m, bn) and not isinstance(m, torch.nn.SyncBatchNorm) for m in layers),
        "sync_batchnorm": sum(isinstance(m, torch.nn.SyncBatchNorm) for m in layers),
        "dropout": sum(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in layers),
    }


def _first_batch_size(args) -> int | None:
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim():
            return int(arg.shape[0])
    return None


class ParityRecorder:
    """Records losses and the setup, saves the weights after step K and stops the run (see the module doc)."""

    def __init__(self, engine, request: ParityRequest):
        self.engine = engine
        self.request = request
        self.directory = Path(request.directory)
        self.models: list[torch.nn.Module] = []
        self.micro_losses: list[float] = []
        self.losses: list[float] = []  # one per optimizer step: mean over ranks and micro-steps
        self.learning_rates: list[float] = []  # of the first parameter group, as each step used it
        self.layers: dict = {}
        self.batch_per_forward: int | None = None
        self.buffer_names: list[str] = []  # saved weights that are buffers (BatchNorm statistics), not parameters
        self.steps = 0
        self._hooked_optimizer = False

    # -- hooks the engines call ----------------------------------------------------------------------
    def prepared(self, results):
        """Watch the models (batch size, layers, weights) and count the first optimizer's steps."""
        for result in results:
            if isinstance(result, torch.nn.Module):
                self._watch_model(result)
            elif isinstance(result, torch.optim.Optimizer) and not self._hooked_optimizer:
                # Only the first optimizer counts steps (a GAN's second one steps in lockstep anyway).
                _raw_optimizer(result).register_step_post_hook(self._optimizer_stepped)
                self._hooked_optimizer = True

    def backward(self, loss):
        value = self.engine.reduce(loss.detach().float().mean(), "mean")
        self.micro_losses.append(float(value))
        if self.engine.sync_gradients:  # the last micro-step of this optimizer step
            self.losses.append(sum(self.micro_losses) / len(self.micro_losses))
            self.micro_losses.clear()

    # -- internals -----------------------------------------------------------------------------------
    def _watch_model(self, model):
        self.models.append(model)
        module = self.engine.unwrap_model(model, keep_torch_compile=False)
        handles = []

        def first_training_forward(layer, args):
            if not layer.training:
                return
            self.batch_per_forward = _first_batch_size(args)
            self.layers = describe_layers(layer)
            handles[0].remove()

        handles.append(module.register_forward_pre_hook(first_training_forward))

    def _optimizer_stepped(self, optimizer, args, kwargs):
        self.steps += 1
        self.learning_rates.append(float(optimizer.param_groups[0]["lr"]))
        if self.engine.is_main_process:
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / RECORD_FILE).write_text(json.dumps(self.record(), indent=1))
        if self.steps >= self.request.steps:
            self._save_and_stop()

    def record(self) -> dict:
        engine = self.engine
        cuda = engine.device.type == "cuda"
        tf32 = cuda and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
        return {
            "steps": self.steps,
            "losses": self.losses,
            "learning_rates": self.learning_rates,
            "engine": engine.name,
            "world_size": engine.num_processes,
            "data_parallel_size": getattr(engine, "data_parallel_size", engine.num_processes),
            # a pipeline's forwards are slices of each micro-batch
            "pipeline_slices": getattr(getattr(engine, "parallelism_config", None), "pp_microbatches", None) or 1,
            "mesh": None if getattr(engine, "torch_device_mesh", None) is None else dict(
                zip(engine.torch_device_mesh.mesh_dim_names, engine.torch_device_mesh.shape)),
            "replicas": len(getattr(engine, "device_ids", None) or [0]),  # dp: GPUs one process drives
            "device": engine.device.type,
            "mixed_precision": str(engine.mixed_precision),
            "gradient_accumulation_steps": engine.gradient_accumulation_steps,
            "seed": getattr(engine, "seed", None),
            "batch_per_forward": self.batch_per_forward,
            "tf32": bool(tf32),
            "buffers": self.buffer_names,
            **self.layers,
        }

    def _save_and_stop(self):
        from toolkit.checkpoint.weights import save_model

        engine = self.engine
        states = [engine.get_state_dict(model) for model in self.models]  # every rank: fsdp gathers its shards
        if engine.is_main_process:
            for index, (model, state) in enumerate(zip(self.models, states)):
                save_model(state, self.directory / MODEL_FILE.format(index=index))
                module = engine.unwrap_model(model, keep_torch_compile=False)
                self.buffer_names += [f"model{index}.{name}" if index else name for name, _ in module.named_buffers()]
            (self.directory / RECORD_FILE).write_text(json.dumps(self.record(), indent=1))
            engine.print(f"[toolkit] parity: stopped after {self.steps} optimizer steps as asked; "
                         f"recorded in {self.directory}")
        engine.wait_for_everyone()  # nobody leaves before the weights are on disk
        engine.end_training()
        raise ParityStop()
