"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`) over NCCL or gloo: for models that outgrow one GPU.

Each rank keeps 1/W of every parameter, of its gradient and of the optimizer state; a block's full
parameters exist only while it runs (all-gathered before its forward and backward, freed after), and
gradients are reduce-scattered instead of all-reduced. The world is formed exactly as the ddp engine
forms it; only `_wrap_model`, accumulation, clipping and state dicts differ.

    torchrun --nproc_per_node 2 recipes/cifar.py --engine fsdp
    toolkit launch --config_file accelerate_configs/cpu.yaml --engine fsdp recipes/cifar.py

The model is sharded per block (`shard_units`), then at the root. bf16 goes through FSDP's
MixedPrecisionPolicy (bf16 compute and all-gathers, fp32 gradient reduction and master weights), not
autocast. BatchNorm buffers are not sharded: like DDP, rank 0's are broadcast before each training
forward, so every rank normalises with one model's statistics and a checkpoint holds them.

Parameters fully_shard cannot take stay whole on every rank, as under DDP: scalars (a learned temperature,
Accelerate's RegressionModel) and weights tied across blocks (an embedding and its output head). Their
gradients are averaged over ranks in one all-reduce at the end of each synced backward, and whether a backward
syncs is decided as DDP decides it, for sharded and whole parameters alike: at the forward (under no_sync or
not), unless trigger_sync_in_backward is active when the backward runs. Under bf16 such a model's forward also
runs under autocast, which casts the whole parameters the policy does not reach.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from toolkit.engines.base import TorchEngine, _autocast_forward, amp_dtype
from toolkit.engines.compiling import compile_model, uncompiled
from toolkit.engines.prepared import PreparedOptimizer
from toolkit.engines.group import ProcessGroupMixin
from toolkit.config import listing
from toolkit.errors import UserError
from toolkit.engines.gradient_sync import GradientSync
from toolkit.launch.parallelism import ParallelismConfig, read_parallelism_config
from toolkit.engines.units import checkpoint_modules, shard_units
from toolkit.engines.tensor_parallel import parallelize, whole
from toolkit.engines.mesh import build_mesh
from toolkit.engines.pipeline import Pipeline, share_tied
from toolkit.engines.fsdp_parts import (_RESHARD, FULL, FSDPOptimizer, fsdp_modules, full_parameters,  # noqa: F401
                                        gradient_norm, replicated_parameters)
from toolkit.engines.fsdp_settings import (FSDPSettings, fp32_norms, ignored_parameters, mixed_precision_dtype,
                                           non_persistent_buffers, read_plugin, settings_from_profile, to_meta,
                                           wrapped_units)

class FSDPEngine(ProcessGroupMixin, TorchEngine):
    name = "fsdp"
    distributed_type = "FSDP"  # Accelerate's DistributedType value
    is_fsdp2 = True

    def __init__(self, env, *, fsdp_plugin=None, parallelism_config=None, checkpoint_format: str | None = None,
                 **kwargs):
        # Accelerate's forms (engines/fsdp_settings.py): the plugin given, else the one an FSDP profile makes.
        settings = read_plugin(fsdp_plugin) if fsdp_plugin is not None else (
            settings_from_profile() if env.accelerate_fsdp else None)
        if settings is not None and checkpoint_format not in (None, settings.checkpoint_format):
            raise UserError(f"checkpoint_format {checkpoint_format!r} contradicts the FSDP plugin's state_dict_type "
                            f"{settings.state_dict_type}; set one of them.")
        super().__init__(env, checkpoint_format=checkpoint_format or (settings.checkpoint_format if settings else "full"),
                         **kwargs)
        self.fsdp_plugin, self.fsdp_settings = fsdp_plugin, settings
        # Accelerate's ParallelismConfig (engines/parallelism.py): dp_shard alone, or dp_replicate x dp_shard (HSDP).
        config = parallelism_config if parallelism_config is not None else (
            ParallelismConfig(**env.parallelism_sizes) if env.parallelism_sizes else None)
        self.parallelism_config = None if config is None else read_parallelism_config(config)
        # tp splits each layer (engines/tensor_parallel.py), pp cuts the model into stages (engines/pipeline.py);
        # FSDP shards over the data-parallel dimensions only.
        self._parts = build_mesh(self.parallelism_config, self._world, self.device.type, self.name)
        self._mesh, self._dp_mesh, self._tp_mesh = self._parts.mesh, self._parts.data, self._parts.tp
        self._data_group = self._parts.data_group
        self.torch_device_mesh = None if config is None else self._mesh
        self._pipelines: dict = {}  # prepared model -> its stage (engines/pipeline.py), under pp
        if self._parts.pp_size > 1:
            if checkpoint_format == "full":
                raise UserError("under pipeline parallel each stage holds its own blocks: save_state writes the "
                                "sharded format; use checkpoint_format sharded (--checkpoint-format sharded).")
            self.checkpoint_format = "sharded"
            if settings is not None:  # every rank builds the whole model before its stage is cut from it (Accelerate's
                # profiles turn this on by default; it saves memory at load time only, and a stage is already a part)
                self.fsdp_settings = dataclasses.replace(settings, cpu_ram_efficient_loading=False)
        self._loss_parallel = False  # forward_backward's: the logits stay split over the vocabulary for the loss
        self._swapped = {}  # original parameter -> its sharded replacement (optimizers built before prepare)
        self._whole_names = {}  # original parameter -> its name in the whole model
        self._models = []
        self._syncs: dict[torch.nn.Module, GradientSync] = {}  # prepared model -> when its gradients sync

    def prepare_model(self, model):
        # Not the base's autocast: MixedPrecisionPolicy casts the gathered parameters instead. It does not
        # reach the replicated ones: where there are some, autocast casts them (a tied fp32 head would meet
        # bf16 activations), and hands them fp32 gradients, as the policy does for the sharded ones.
        efficient = self.fsdp_settings is not None and self.fsdp_settings.cpu_ram_efficient_loading
        model = self._wrap_model(model if efficient else model.to(self.device))  # meta weights stay there until sharded
        dtype = mixed_precision_dtype(self.fsdp_settings, amp_dtype(self.mixed_precision))
        if dtype is not None and self._syncs[model].replicated:
            model.forward = _autocast_forward(model.forward, self.device.type, dtype)
        if self.compile_settings is not None and not self.compile_settings.regional:
            model = compile_model(model, self.compile_settings)  # over the sharded root, as Accelerate compiles last
        return model

    def _wrap_model(self, model):
        settings = self.fsdp_settings or FSDPSettings(reshard_after_forward=None)  # None: fully_shard's own default
        names: dict = {}  # every name of each parameter: a tied one may keep only its other name on a pipeline stage
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(name)
        pipeline = self._cut(model)
        dtype = amp_dtype(self.mixed_precision)
        # bf16 compute, fp32 gradient reduction; the blocks hand on bf16 activations, the root fp32 outputs.
        policy = settings.mixed_precision_policy or MixedPrecisionPolicy(
            param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        root_policy = settings.mixed_precision_policy or dataclasses.replace(
            policy, output_dtype=torch.float32 if dtype else None)
        units, norms = self._units(model, settings, policy.param_dtype)
        replicated_by_name = replicated_parameters(model, units)
        ignored = set(ignored_parameters(model, settings.ignored_modules))
        replicated = [p for p in model.parameters() if p in ignored or any(p is q for q in replicated_by_name.values())]
        if replicated and self.scaler is not None:
            # torch's GradScaler checks a step's gradients in one call that must be all sharded or all whole.
            kept_whole = [name for name, p in model.named_parameters() if any(p is q for q in replicated)]
            raise UserError(f"the fsdp engine cannot train fp16 with parameters it keeps whole ({listing(kept_whole, 3)}: "
                            f"scalars, tied weights or ignored_modules); use bf16, or the ddp engine for fp16.")
        full, kept = {}, {}
        if settings.cpu_ram_efficient_loading:
            # Accelerate's: only the main process holds real weights; the others may have built the model on the
            # meta device. Sharding happens on meta, then rank 0's weights are scattered into the shards.
            full = model.state_dict() if self.is_main_process else {}
            kept = non_persistent_buffers(model)
            moved = to_meta(model)
            replicated = [moved.get(p, p) for p in replicated]
        elif pipeline is None:
            self._from_rank0(model)
        replicated = self._tensor_parallel(model, replicated)
        kwargs = dict(mesh=self._dp_mesh, mp_policy=policy, ignored_params=set(replicated),
                      offload_policy=CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if settings.cpu_offload
                      else OffloadPolicy())
        for unit in units:
            fp32 = MixedPrecisionPolicy(reduce_dtype=policy.reduce_dtype, output_dtype=policy.param_dtype)
            fully_shard(unit, reshard_after_forward=settings.reshard_after_forward,
                        **{**kwargs, "mp_policy": fp32 if unit in norms else policy})
            if settings.reshard_after_forward is not None:
                _RESHARD[unit] = settings.reshard_after_forward
        fully_shard(model, **{**kwargs, "mp_policy": root_policy})
        if settings.cpu_ram_efficient_loading:
            model.to_empty(device=self.device)
            for name, buffer in kept.items():  # not in a state dict: each rank's own, as before
                owner, _, leaf = name.rpartition(".")
                model.get_submodule(owner).register_buffer(leaf, buffer.to(self.device), persistent=False)
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        self._syncs[model] = GradientSync(model, replicated, self.data_parallel_size, self._data_group)
        self._whole_outputs(model)
        # DDP's name, which FSDP2 lacks: a script that accumulates with `model.no_sync()` (as on DDP and FSDP1)
        # keeps each micro-batch's gradients on its rank until a backward outside it reduces them all.
        model.no_sync = functools.partial(self._no_sync, model)
        self._follow(model, names, pipeline)
        if self._world > 1 and any(True for _ in model.buffers()):
            model.register_forward_pre_hook(self._broadcast_buffers)
        return model

    # The processes that read different batches: the tp ranks of one group read the same (tp innermost).
    data_parallel_size = property(lambda self: self._parts.data_parallel_size)
    data_parallel_index = property(lambda self: self._parts.data_parallel_index(self._rank))

    def _local_rank(self, dim: str) -> int:  # Accelerate's: 0 along a dimension the mesh does not have
        names = self._mesh.mesh_dim_names
        return self._mesh.get_local_rank(dim) if self.torch_device_mesh is not None and dim in names else 0

    data_parallel_rank = property(lambda self: self._local_rank("dp_replicate"))
    tensor_parallel_rank = property(lambda self: self._local_rank("tp"))

    @property
    def data_parallel_shard_rank(self) -> int:
        return self._local_rank("dp_shard") if self.torch_device_mesh is not None else self._rank

    def forward_backward(self, model, inputs, targets, loss_fn, backward_if=None):
        """As on every engine; under tp the loss runs on logits split over the vocabulary (torch's loss_parallel:
        each rank's share of the softmax, never the whole logits), and the loss comes back whole. Under pp it is the
        schedule over micro-batches (engines/pipeline.py); its mean loss comes back on every stage."""
        pipeline = self._pipelines.get(uncompiled(model))
        if pipeline is not None:
            self._loss_parallel = self._tp_mesh is not None  # the last stage's loss on the vocabulary's shards
            try:
                with loss_parallel() if self._loss_parallel else contextlib.nullcontext():
                    loss = pipeline.step(model, inputs, targets, loss_fn, self.gradient_accumulation_steps)
            finally:
                self._loss_parallel = False
            self._observers.backward(loss)
            if self.sync_gradients:
                pipeline.sum_tied(uncompiled(model))
            if backward_if is not None and not backward_if(loss):
                raise UserError("a pipeline's loss is known only once its schedule has run the backward, so a step "
                                "cannot be skipped under pp_size; train without --skip-nonfinite there.")
            return loss
        if self._tp_mesh is None:
            return super().forward_backward(model, inputs, targets, loss_fn, backward_if)
        self._loss_parallel = True
        try:
            with loss_parallel():
                loss = whole(loss_fn(model(inputs), targets))
                if backward_if is None or backward_if(loss):
                    self.backward(loss)
        finally:
            self._loss_parallel = False
        return loss

    def _follow(self, model, names: dict, pipeline):
        """fully_shard (and a pipeline's cut) replaced every parameter: optimizers made before must follow, by name
        (to None: a parameter another pipeline stage holds); under pp the model's calls run the pipeline."""
        sharded = dict(model.named_parameters())
        self._swapped.update({old: next((sharded[n] for n in found if n in sharded), None) for old, found in names.items()})
        self._whole_names.update({old: found[0] for old, found in names.items()})
        if pipeline is not None:
            self._pipelines[model] = pipeline
            model.forward = functools.partial(pipeline.forward, model)

    def _from_rank0(self, model):
        """As DDP does when it wraps: every rank starts from rank 0's weights (ranks seeded apart initialise
        differently, and fully_shard would keep each rank's own slice of its own init)."""
        if self._world > 1:
            with torch.no_grad():
                for tensor in model.state_dict().values():
                    dist.broadcast(tensor, src=0)

    def _cut(self, model):
        """Under pp: the whole model from rank 0, then cut to this rank's stage (engines/pipeline.py)."""
        if self._parts.pp_size == 1:
            return None
        self._from_rank0(model)
        config = self.parallelism_config
        return Pipeline(model, self._mesh, config.pp_schedule, config.pp_microbatches, self.device)

    def _tensor_parallel(self, model, replicated: list) -> list:
        """Split the model by its tp plan over the mesh's tp dimension; the parameters FSDP keeps whole, found
        again by name (the plan replaces every parameter)."""
        if self._tp_mesh is None:
            return replicated
        kept = [name for name, p in model.named_parameters() if any(p is q for q in replicated)]
        parallelize(model, self._tp_mesh)
        return [model.get_parameter(name) for name in kept]

    def _whole_outputs(self, model):
        """Under tp, `model(x)` gives whole logits, as on one process (forward_backward keeps them split); hooked
        after GradientSync's, which then sees the outputs the backward starts from."""
        if self._tp_mesh is not None:
            model.register_forward_hook(lambda module, args, output: output if self._loss_parallel else whole(output))

    def _units(self, model, settings: FSDPSettings, param_dtype) -> tuple[list, list]:
        """The modules sharded one by one before the root, and those of them that stay fp32 (`fp32_norms`): without
        settings each block (shard_units), with Accelerate's those its wrap policy picks, checkpointed when it asks;
        compiled region by region first when asked (in place, so FSDP's hooks stay outside the graphs)."""
        units = (shard_units(model) if self.fsdp_settings is None
                 else wrapped_units(model, settings.wrap) if settings.wrap is not None else [])
        if settings.activation_checkpointing:
            if settings.wrap is None:
                raise UserError("activation_checkpointing checkpoints the modules the auto_wrap_policy picks; set "
                                "auto_wrap_policy (transformer_based_wrap or size_based_wrap) with it.")
            checkpoint_modules(units)
        if self.compile_settings is not None and self.compile_settings.regional:
            compile_model(model, self.compile_settings)
        norms = fp32_norms(model, param_dtype)
        return norms + [u for u in units if not any(u is n for n in norms)], norms

    def _broadcast_buffers(self, model, args):
        if model.training and torch.is_grad_enabled() and self.sync_gradients:
            for buffer in model.buffers():
                dist.broadcast(buffer, src=0)

    def _prepare_one(self, obj):
        if isinstance(obj, torch.optim.Optimizer) and not isinstance(obj, PreparedOptimizer):
            return self._prepare_optimizer(obj)
        return super()._prepare_one(obj)

    def _prepare_optimizer(self, optimizer):
        if optimizer.state:
            raise UserError("prepare the optimizer before its first step under the fsdp engine: sharding "
                            "replaces the parameters its state belongs to.")
        # Under pp another stage's parameters leave this rank's optimizer; a checkpoint still names every group's
        # parameters of the whole model (toolkit/checkpoint/sharded.py), so that one process can read it back.
        whole = [[self._whole_names.get(p) for p in group["params"]] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["params"] = [self._swapped.get(p, p) for p in group["params"] if self._swapped.get(p, p) is not None]
        if self._pipelines and all(None not in names for names in whole):
            optimizer.whole_param_names = whole
        # Its first parameter names its model; a group may be empty (a frozen backbone's, under --head-lr).
        first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        owners = [m for m in self._models if any(p is first for p in m.parameters())]
        if not owners:
            raise UserError("prepare the model together with (or before) its optimizer under the fsdp engine.")
        prepared = FSDPOptimizer(optimizer, self, uncompiled(owners[0]))
        self._optimizers.append(prepared)
        return prepared

    def prepare(self, *objects, device_placement=None):
        # Models first, so an optimizer passed before its model in the same call still finds it.
        models = {id(o): self.prepare_model(o) for o in objects if isinstance(o, torch.nn.Module)}
        self._models += models.values()
        prepared = [models[id(o)] if id(o) in models else self._prepare_one(o) for o in objects]
        self._observers.prepared(prepared)
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _no_sync(self, model):
        sync = self._syncs.get(model)
        return sync.off() if sync is not None else contextlib.nullcontext()

    def _trigger_sync(self, model):
        sync = self._syncs.get(model)
        return sync.forced() if sync is not None else contextlib.nullcontext()

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Clip by the norm of the FULL gradient: the shards' norms combined over ranks, and the replicated
        gradients' (whole and equal on every rank) counted once."""
        self.unscale_gradients()
        parameters = [p for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)
                      if p.grad is not None]
        # One group per mesh the gradients live on (FSDP's, tp's, both), and the whole ones'
        meshes = {id(p.grad.device_mesh): p.grad.device_mesh for p in parameters if isinstance(p.grad, DTensor)}
        groups = counted = [[p for p in parameters if isinstance(p.grad, DTensor) and p.grad.device_mesh is mesh]
                            for mesh in meshes.values()] + [[p for p in parameters if not isinstance(p.grad, DTensor)]]
        for model, pipeline in self._pipelines.items():  # a weight tied across stages counts once
            counted = [pipeline.counted(model, group) for group in counted]
        norms = [gradient_norm([p.grad for p in group], norm_type) for group in counted]
        total = torch.linalg.vector_norm(torch.stack([n.to(self.device) for n in norms]), norm_type)
        for pipeline in self._pipelines.values():  # every stage's part of the whole model's norm
            total = pipeline.combine_norm(total, norm_type)
        for group in groups:  # one foreach call cannot mix DTensor and plain gradients
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
        return total

    def gathered_parameters(self, model):
        """Every block of the model unsharded until exit (see `full_parameters`)."""
        return full_parameters(model)

    def get_state_dict(self, model, unwrap: bool = True):
        """The full, unsharded state dict on the main process, in CPU memory (a collective: call it on every rank;
        the others get an empty dict). An FSDP plugin's state_dict_config with rank0_only=False hands it to every
        rank, and offload_to_cpu=False leaves it on the device."""
        settings, module = self.fsdp_settings, self.unwrap_model(model, keep_torch_compile=False)
        pipeline = self._pipelines.get(module)
        if pipeline is not None:  # every stage's part, gathered on the main process
            return pipeline.whole_state_dict(module, self.is_main_process)
        if settings is None or settings.rank0_only:
            return share_tied(module, get_model_state_dict(module, options=FULL))
        full = share_tied(module, get_model_state_dict(module, options=StateDictOptions(full_state_dict=True)))
        return {k: v.cpu() for k, v in full.items()} if settings.offload_to_cpu else full

    def load_full_state_dict(self, model, state_dict):
        """Load a full state dict (every rank holds it) into the sharded model: each keeps its shards."""
        # A copy: set_model_state_dict puts the shards it makes into the dict it is given.
        set_model_state_dict(self.unwrap_model(model, keep_torch_compile=False), dict(state_dict), options=StateDictOptions(full_state_dict=True))
