"""Injected bugs that the suite must catch: each one breaks a key invariant (parity, resume, averaging,
exact evaluation, one writer), and tests/test_mutations.py runs the cheapest tests that catch it with the
bug applied and expects them to fail. A test that stays green with a bug in the code it names cannot fail.

Apply one by hand (every Python process started below gets it, torchrun workers included):

    TOOLKIT_MUTATION=optimizer-step-noop PYTHONPATH=tests/mutant:. python -m pytest tests/test_parity.py

tests/mutant/sitecustomize.py reads TOOLKIT_MUTATION and patches the module named here as it is imported. Each
mutation names the function it changes (`target`, an attribute path in `module`) and replaces exactly that one:
a patch is a function of the original (and the module) that returns the broken copy. A target that no longer
exists, or a recipe edit whose lines no longer occur once in its function, is one line (`Stale`), never a
mutation that silently stays green.
"""

import ast
import contextlib
import functools
from dataclasses import dataclass


class Stale(Exception):
    """The mutation no longer applies to the code: its message is the one line that says why."""


@dataclass(frozen=True)
class SourceEdit:
    """A bug in a recipe's own loop, where no toolkit function holds the line: each (old, new) replaces the lines
    `old` (compared without indentation and trailing comments) that occur exactly once in the target function,
    by `new`, indented as the first line it replaces. The tests that catch it run the recipe as
    `python -m recipes.NAME` (or import it), which the patching finder sees; `python recipes/NAME.py` it does not."""
    edits: tuple

    def rewrite(self, source: str, function: str) -> str:
        lines = source.splitlines(keepends=True)
        node = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == function),
                    None)
        if node is None:
            raise Stale(f"the recipe has no function {function}")
        start, end = node.lineno - 1, node.end_lineno
        body = lines[start:end]
        for old, new in self.edits:
            body = _replace_lines(body, old, new, function)
        return "".join(lines[:start] + body + lines[end:])


def _code(line: str) -> str:
    return line.split("#", 1)[0].strip()


def _replace_lines(body: list, old: tuple, new: tuple, function: str) -> list:
    runs = [i for i in range(len(body) - len(old) + 1) if all(_code(body[i + k]) == o for k, o in enumerate(old))]
    if len(runs) != 1:
        raise Stale(f"{function}'s lines {' / '.join(old)!r} occur {len(runs)} times, not once")
    at, indent = runs[0], body[runs[0]][:len(body[runs[0]]) - len(body[runs[0]].lstrip())]
    return body[:at] + [indent + line + "\n" for line in new] + body[at + len(old):]


@dataclass(frozen=True)
class Mutation:
    module: str  # patched right after this module is first imported
    target: str  # the function it changes: an attribute path in `module` ("TorchEngine.backward")
    patch: object  # fn(original, module) -> the broken replacement; or a SourceEdit of the target's lines
    caught_by: tuple  # pytest node ids that must fail with the bug in (the cheapest that do)
    breaks: str  # the invariant, in words
    needs: str | None = None  # a module the catching tests need, from an extra (they skip without it)

    def _owner(self, module) -> tuple:
        """(the object holding `target`, its attribute name, the original); Stale when it is not there."""
        *path, name = self.target.split(".")
        try:
            owner = functools.reduce(getattr, path, module)
            return owner, name, getattr(owner, name)
        except AttributeError:
            raise Stale(f"{module.__name__} has no {self.target}") from None

    def apply(self, module):
        """Replace `target` in the imported `module` by the patch's broken copy."""
        owner, name, original = self._owner(module)
        setattr(owner, name, self.patch(original, module))

    def check(self, module_or_source) -> None:
        """Raise Stale unless the mutation applies: to the imported module, or to a recipe's source text."""
        if isinstance(self.patch, SourceEdit):
            self.patch.rewrite(module_or_source, self.target)
        else:
            self._owner(module_or_source)


# cifar.py's step: the gradient clipped on every micro-step (each partial sum of an accumulated step), not once.
_CLIP_EVERY_MICRO_STEP = SourceEdit(((
    ("if accelerator.sync_gradients and cfg.clip_grad_norm:",), ("if cfg.clip_grad_norm:",)),))
# cifar.py's step: the weight average moved on every micro-step, not once per optimizer step.
_EMA_EVERY_MICRO_STEP = SourceEdit((
    (("if ema:", "ema.update()", "accelerator.log(run.step_done(lr=scheduler.get_last_lr()[0], **norm, **guard.step_done()),"),
     ("accelerator.log(run.step_done(lr=scheduler.get_last_lr()[0], **norm, **guard.step_done()),",)),
    (("optimizer.zero_grad(set_to_none=True)",),
     ("optimizer.zero_grad(set_to_none=True)", "if ema:", "    ema.update()"))))


def _head_lr_ignored(decay_groups, optim):
    return lambda model, weight_decay, head=(), head_lr=None: decay_groups(model, weight_decay)


def _confusion_from_rank0_shard(update, evaluation):
    def rank0_shard(self, logits, targets):
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        share = -(-len(targets) // world)  # a gathered batch is the ranks' batches in rank order
        update(self, logits[:share], targets[:share])

    return rank0_shard


def _data_wait_in_compute(waited, cost):
    return lambda self, seconds: None  # the time blocked on the loader lands in compute


def _peak_memory_of_rank_0(gathered, run):
    def gathered_peak_memory(self):
        import torch

        mine = torch.tensor([run.peak_memory_bytes(self.accelerator.device)])
        rank0 = self.accelerator.reduce(mine * (self.accelerator.process_index == 0), "sum")  # rank 0's, everywhere
        return int(rank0), int(rank0)

    return gathered_peak_memory


def _optimizer_step_noop(step, prepared):
    return lambda self, closure=None: None


def _optimizer_mode_not_forwarded(mode, prepared):
    return lambda self: None


def _no_sync_still_reduces(wrap, fsdp):
    def wrap_model(self, model):
        import contextlib

        wrapped = wrap(self, model)
        wrapped.no_sync = contextlib.nullcontext  # the name is there; every backward still reduce-scatters
        return wrapped

    return wrap_model


def _norm_of_one_shard(gradient_norm, fsdp):
    def this_ranks_shard(grads, norm_type):
        return gradient_norm([g.to_local() if isinstance(g, fsdp.DTensor) else g for g in grads], norm_type)
    return this_ranks_shard


def _tp_ranks_read_apart(index, fsdp):  # the mesh's order mistaken: tp taken as the outer dimension
    return property(lambda self: self._rank % self.data_parallel_size)


def _microbatch_losses_summed(scaled_loss, pipeline):
    def summed(self, output, target):  # divided by the accumulation only: the micro-batches' gradients add up
        return scaled_loss(self, output, target) * self.microbatches
    return summed


def _stage_takes_the_first_blocks(stage_blocks, pipeline):
    def first_blocks(blocks, indices):  # the stage's numbers, but the whole model's first blocks' weights
        return pipeline.nn.ModuleDict({str(i): blocks[k] for k, i in enumerate(indices)})
    return first_blocks


def _reshard_ignored(read_plugin, settings):
    import dataclasses

    # The plugin's reshard_after_forward is dropped: every unit reshards after its forward, as by default.
    return lambda plugin: dataclasses.replace(read_plugin(plugin), reshard_after_forward=True)


def _compiled_keys_saved(get_state_dict, base):
    # The state dict of the compiled wrapper (Accelerate's unwrap default keeps it): every key gains `_orig_mod.`.
    return lambda self, model, unwrap=True: self.unwrap_model(model).state_dict()


def _gradients_summed(backward, base):
    return lambda self, loss, **kw: backward(self, loss * self.num_processes, **kw)


def _bn_stats_summed(average, training):
    def average_batchnorm_stats(model, accelerator):
        for layer in training.batchnorm_layers(accelerator.unwrap_model(model)):
            layer.running_mean.copy_(accelerator.reduce(layer.running_mean, "sum"))
            layer.running_var.copy_(accelerator.reduce(layer.running_var, "sum"))

    return average_batchnorm_stats


def _resume_at_epoch_start(resume_position, training):
    return lambda state, samples, acc: resume_position(state, samples, acc)[:2] + (0,)


def _position_not_resharded(resume_position, position):
    def old_worlds_batches(state, samples_per_step, accelerator):  # the old world's per-process count, kept
        step, epoch, done = resume_position(state, samples_per_step, accelerator)
        return step, epoch, done * accelerator.num_processes // (state.get("world_size") or accelerator.num_processes)

    return old_worlds_batches


def _accumulation_from_checkpoint(load_state_dict, run):
    def keeps_the_old_worlds(self, state):  # the checkpoint's accumulation restored instead of re-derived
        load_state_dict(self, state)
        old = (state.get("attempts") or [{}])[-1].get("accumulation")
        if old:
            self.plan.__dict__["accumulation"] = old  # a frozen dataclass
            self.accelerator.gradient_accumulation_steps = old

    return keeps_the_old_worlds


def _schedule_restarts_on_world_change(read_rest, state_module):
    def restarted(path, registries, rank, step, *rest):  # another world: the lr schedule's count starts again
        import torch.distributed as dist

        step, state = read_rest(path, registries, rank, step, *rest)
        if state.get("world_size") != (dist.get_world_size() if dist.is_initialized() else 1):
            for scheduler in registries.custom_objects or ():
                if hasattr(scheduler, "last_epoch"):
                    scheduler.last_epoch = 0
        return step, state

    return restarted


def _checkpoint_drops_optimizer(load, checkpoint):
    return lambda path, optimizer=None, **kw: load(path, **kw)


def _metrics_keep_padding(gather_for_metrics, base):
    return lambda self, data: self.gather(data)


def _every_rank_writes(init, records):
    return lambda self, output_dir, active: init(self, output_dir, True)


def _augment_from_global_rng(sample_rng, data):
    return lambda seed, epoch, index: contextlib.nullcontext()  # the transforms draw from torch's RNG


def _save_state_skips_scheduler(write_rest, state_module):
    def without_schedulers(temp, state_text, registries, rng_states):
        write_rest(temp, state_text, state_module.Registries([], registries.scaler, registries.custom_objects),
                   rng_states)

    return without_schedulers


def _skip_one_batch_too_few(skipping, prepared):
    return lambda self, n: skipping(self, max(0, n - 1))


def _sync_gradients_always(do_sync, base):
    def always(self):
        do_sync(self)
        self.sync_gradients = True

    return always


def _log_on_every_rank(init_trackers, base):
    def on_every_rank(self, project_name, config=None, init_kwargs=None):
        from toolkit.engines.tracking import build_trackers

        self.trackers = build_trackers(self.log_with, project_name, self.logging_dir, config, init_kwargs or {})

    return on_every_rank


def _resume_rewrites_summary(finished, run):
    return lambda self, saved, path: False  # the finished run is evaluated and summarised again


def _counters_restart(continue_from, records):
    return lambda self, elapsed_s: None  # a resume's clock starts again at 0


def _files_keep_tempfile_mode(honour_umask, weights):
    return lambda *paths: None  # safetensors' 0600 temporary file stays the checkpoint's weights


def _threads_left_to_torch(set_threads, engines):
    from toolkit.launch.env import threads_per_process

    return lambda env: threads_per_process(env, current=0)  # said, never set


def _abbreviations_taken(init, config):
    return lambda self, *args, **kwargs: init(self, *args, **{**kwargs, "allow_abbrev": True})


def _adam_state_counted_once(optimizer_state, memory):
    return lambda trace, held: held  # one state tensor per parameter, whatever the optimizer keeps


def _fsdp_share_whole(fsdp_share, memory):
    return lambda nbytes, rows, ranks: nbytes  # each rank holds the whole tensor, as under ddp


def _all_reduce_at_1x(all_reduce_seconds, step_time):
    def once(nbytes, ranks, device, messages=1):  # the bytes sent once, not 2(n-1)/n times
        return 0.0 if ranks <= 1 else 2 * (ranks - 1) * device.alpha_s * messages + nbytes / device.beta
    return once


def _config_wins_over_later_flags(parse_config, config):
    def parse(config_class, argv=None, description=None):  # the file's values laid over every flag, wherever it stood
        import dataclasses
        import sys

        cfg = parse_config(config_class, argv, description)
        words = [str(word) for word in (sys.argv[1:] if argv is None else argv)]
        if "--config" in words:
            cfg = dataclasses.replace(cfg, **config.read_config_file(words[words.index("--config") + 1]))
        return cfg
    return parse


def _node_rank_as_rank(torchrun_group, env):
    def group(environ, by_accelerate, legacy_local_rank):  # Kubeflow's node rank taken for the process's rank
        launcher, rank, *rest = torchrun_group(environ, by_accelerate, legacy_local_rank)
        return (launcher, int(environ.get("PET_NODE_RANK", rank)), *rest)
    return group


def _destroys_a_given_group(end_training, group):
    def end(self):  # the group destroyed at the end of training, whoever made it (Ray Train's among them)
        end_training(self)
        if group.dist.is_initialized():
            group.dist.destroy_process_group()
    return end


PARITY, FLAGS, API = "tests/test_parity.py", "tests/test_flags.py", "tests/test_engine_api.py"
PLAN = "tests/test_plan.py"
OPTIMIZERS, RECIPE = "tests/test_optimizers.py", "tests/test_recipe.py"
PIPELINE = "tests/test_pipeline.py::test_the_lm_recipe_trains_under_a_pipeline_as_one_process"
TENSOR_PARALLEL = "tests/test_tensor_parallel.py::test_the_lm_recipe_trains_under_a_tensor_parallel_mesh_as_one_process"
MUTATIONS = {
    "clipping-on-micro-steps": Mutation(
        "recipes.cifar", "main", _CLIP_EVERY_MICRO_STEP,
        (f"{OPTIMIZERS}::test_adamw_cosine_clipping_and_ema_match_the_hand_written_loop",),
        "clipping: each micro-batch's partial gradient is clipped, so accumulation changes the step"),
    "ema-every-micro-step": Mutation(
        "recipes.cifar", "main", _EMA_EVERY_MICRO_STEP,
        (f"{OPTIMIZERS}::test_adamw_cosine_clipping_and_ema_match_the_hand_written_loop",),
        "EMA: the average moves once per micro-step, so its horizon shrinks with accumulation"),
    "confusion-from-rank-0-shard": Mutation(
        "toolkit.train.evaluation", "EvalMetrics._update_by_class", _confusion_from_rank0_shard,
        ("tests/test_evaluation.py::test_two_gloo_ranks_count_what_one_process_counts",),
        "exact eval: the confusion matrix counts rank 0's shard of each gathered batch only"),
    "data-wait-in-compute": Mutation(
        "toolkit.train.cost", "StepCost.waited", _data_wait_in_compute,
        ("tests/test_cost.py::test_the_data_wait_is_the_time_blocked_on_the_loader_and_a_data_bound_run_is_said_once",),
        "cost: the time blocked on the loader is counted as compute, so a data-bound run looks compute-bound"),
    "peak-memory-of-rank-0": Mutation(
        "toolkit.train.run", "TrainingRun.gathered_peak_memory", _peak_memory_of_rank_0,
        ("tests/test_cost.py::test_the_peak_memory_is_gathered_from_every_rank",),
        "cost: the peak memory reported is rank 0's, so a rank near its device's limit goes unseen"),
    "head-lr-ignored": Mutation(
        "toolkit.train.optim", "decay_groups", _head_lr_ignored,
        (f"{OPTIMIZERS}::test_a_frozen_backbone_stays_and_the_head_trains_at_head_lr",),
        "fine-tuning: --head-lr is dropped and the head trains at the backbone's lr"),
    "files-keep-tempfile-mode": Mutation(
        "toolkit.checkpoint.weights", "honour_umask", _files_keep_tempfile_mode,
        ("tests/test_checkpoint.py::test_every_file_a_save_writes_has_the_mode_the_umask_gives",),
        "shared storage: a checkpoint's weights keep safetensors' 0600, unreadable to teammates"),
    "threads-left-to-torch": Mutation(
        "toolkit.engines", "set_threads", _threads_left_to_torch,
        ("tests/test_threads.py::test_build_accelerator_sets_the_count_and_says_it",),
        "threads: the start line names a count torch was never given (N processes x all cores)"),
    "abbreviations-taken": Mutation(
        "toolkit.config", "StrictParser.__init__", _abbreviations_taken,
        (f"{FLAGS}::test_an_abbreviated_flag_is_refused_in_one_sentence_naming_the_flag",),
        "messages: --epoch is silently taken as --epochs"),
    "resume-rewrites-summary": Mutation(
        "toolkit.train.run", "TrainingRun._finished", _resume_rewrites_summary,
        ("tests/test_train_parts.py::test_resuming_a_finished_run_reports_its_summary_and_loads_and_writes_nothing",),
        "records: --resume of a finished run trains nothing yet rewrites summary.json (its throughput and wall time lost)"),
    "counters-restart": Mutation(
        "toolkit.train.records", "RunRecorder.continue_from", _counters_restart,
        ("tests/test_train_parts.py::test_a_resume_continues_the_records_clock_and_keeps_every_attempt",),
        "records: after a resume the steps' time column starts again from 0"),
    "optimizer-step-noop": Mutation(
        "toolkit.engines.prepared", "PreparedOptimizer.step", _optimizer_step_noop,
        (f"{PARITY}::test_one_process_matches_the_hand_written_loop",),
        "parity: PreparedOptimizer.step does nothing (shared by single, dp and ddp)"),
    "optimizer-eval-not-forwarded": Mutation(
        "toolkit.engines.prepared", "PreparedOptimizer.eval", _optimizer_mode_not_forwarded,
        ("tests/test_prepared_names.py::test_a_schedule_free_optimizer_evaluates_at_its_averaged_weights_as_without_an_accelerator[single]",),
        "accelerate's meaning: optimizer.eval() leaves a schedule-free optimizer at its training weights"),
    "no-sync-still-reduces": Mutation(
        "toolkit.engines.fsdp", "FSDPEngine._wrap_model", _no_sync_still_reduces,
        ("tests/test_fsdp.py::test_model_no_sync_accumulates_as_on_ddp_and_reduces_once_per_optimizer_step",),
        "accelerate's meaning: model.no_sync() under fsdp still reduces every micro-batch's gradients"),
    "clip-norm-of-one-tp-shard": Mutation(
        "toolkit.engines.fsdp", "gradient_norm", _norm_of_one_shard,
        (f"{TENSOR_PARALLEL}[tp2]",),
        "clipping under tp: the gradient's norm is this rank's shard's, so each tp rank clips by another factor"),
    "tp-ranks-read-different-batches": Mutation(
        "toolkit.engines.fsdp", "FSDPEngine.data_parallel_index", _tp_ranks_read_apart,
        (f"{TENSOR_PARALLEL}[dp_shard2_tp2]",),
        "tensor parallel: the ranks of one tp group read different batches, so each layer's shards see other data"),
    "pipeline-microbatch-losses-summed": Mutation(
        "toolkit.engines.pipeline", "Pipeline._scaled_loss", _microbatch_losses_summed,
        (f"{PIPELINE}[pp2_1f1b]",),
        "pipeline: the micro-batches' losses are summed, so the step's gradient grows with their count"),
    "stage-loads-the-wrong-blocks": Mutation(
        "toolkit.engines.pipeline", "stage_blocks", _stage_takes_the_first_blocks,
        (f"{PIPELINE}[pp2_1f1b]",),
        "pipeline: the last stage holds the first block's weights under its own block's name"),
    "reshard-after-forward-ignored": Mutation(
        "toolkit.engines.fsdp_settings", "read_plugin", _reshard_ignored,
        ("tests/test_fsdp_settings.py::test_reshard_after_forward_false_keeps_the_gathered_weights_for_backward",),
        "accelerate's meaning: the fsdp engine reshards after every forward whatever the FSDP plugin says"),
    "compiled-weights-saved-with-orig-mod": Mutation(
        "toolkit.engines.base", "TorchEngine.get_state_dict", _compiled_keys_saved,
        ("tests/test_compile.py::test_a_compiled_models_save_state_loads_into_an_uncompiled_one",),
        "checkpoints: a compiled model's weights are saved as `_orig_mod.*`, which an uncompiled run cannot load"),
    "gradients-summed": Mutation(
        "toolkit.engines.base", "TorchEngine.backward", _gradients_summed,
        (f"{PARITY}::test_two_ranks_match_one_process_with_double_batch[ddp]",),
        "averaging: each rank's loss is scaled by the world size, so DDP's mean of gradients is their sum"),
    "bn-stats-summed": Mutation(
        "toolkit.train.batchnorm", "average_batchnorm_stats", _bn_stats_summed,
        (f"{FLAGS}::test_sync_bn_on_two_cpu_ranks_says_so_once_and_saves_the_mean_of_the_ranks_statistics",),
        "averaging: --sync-bn's CPU fallback sums the ranks' BatchNorm statistics"),
    "resume-at-epoch-start": Mutation(
        "toolkit.train.data_position", "resume_position", _resume_at_epoch_start,
        ("tests/test_checkpoint.py::test_resume_position_maps_samples_to_steps",),
        "resume: a mid-epoch checkpoint restarts its epoch from the first batch"),
    "position-not-resharded": Mutation(
        "toolkit.train.data_position", "resume_position", _position_not_resharded,
        ("tests/test_checkpoint.py::test_resume_position_maps_samples_to_steps",),
        "elastic: a resume on another world keeps the old world's per-process position (samples seen again)"),
    "accumulation-not-re-derived": Mutation(
        "toolkit.train.run", "TrainingRun.load_state_dict", _accumulation_from_checkpoint,
        ("tests/test_train_parts.py::test_the_position_maps_through_samples_to_another_world_size",),
        "elastic: a resume on another world keeps the old accumulation (the global batch changes)"),
    "schedule-restarts-on-world-change": Mutation(
        "toolkit.checkpoint.state", "read_rest", _schedule_restarts_on_world_change,
        ("tests/test_checkpoint.py::test_a_schedule_saved_by_two_processes_goes_on_from_its_count_on_one",),
        "elastic: the lr schedule's step count starts again after a world change"),
    "checkpoint-drops-optimizer": Mutation(
        "toolkit.checkpoint.functional", "load_checkpoint", _checkpoint_drops_optimizer,
        ("tests/test_checkpoint.py::test_round_trip_restores_everything",),
        "resume: loading a checkpoint leaves the optimizer's momentum behind"),
    "metrics-keep-padding": Mutation(
        "toolkit.engines.base", "TorchEngine.gather_for_metrics", _metrics_keep_padding,
        ("tests/test_two_ranks.py::test_torchrun[ddp]",),
        "exact eval: gather_for_metrics keeps the samples the sampler repeated as padding"),
    "augment-from-global-rng": Mutation(
        "toolkit.data.memory", "sample_rng", _augment_from_global_rng,
        ("tests/test_data_models.py::test_torch_loader_augments_each_sample_by_seed_epoch_and_index_alone",),
        "resume and world-size independence: --loader torch draws crops and flips from the global RNG "
        "(caught on 2 ranks too by test_flags.py::test_torch_loader_resumes_mid_epoch_on_two_ranks_where_the_...)"),
    "every-rank-writes": Mutation(
        "toolkit.train.records", "RunRecorder.__init__", _every_rank_writes,
        (f"{FLAGS}::test_only_the_main_process_writes",),
        "one writer: every rank appends to metrics.jsonl and steps.csv"),
    "save-state-skips-scheduler": Mutation(
        "toolkit.checkpoint.state", "_write_rest", _save_state_skips_scheduler,
        (f"{API}::test_save_state_restores_everything_and_load_state_verifies[single]",),
        "resume: save_state leaves the learning-rate schedule out of the folder"),
    "skip-first-batches-one-too-few": Mutation(
        "toolkit.engines.prepared", "PreparedDataLoader.skipping", _skip_one_batch_too_few,
        (f"{API}::test_skip_first_batches_resumes_the_same_epoch_mid_way",),
        "mid-epoch resume: skip_first_batches trains one batch of the epoch twice"),
    "sync-gradients-always-true": Mutation(
        "toolkit.engines.base", "TorchEngine._do_sync", _sync_gradients_always,
        ("tests/test_contract.py::test_contract[single]",),
        "accumulation: every micro-step syncs and steps the optimizer"),
    "log-on-every-rank": Mutation(
        "toolkit.engines.base", "TorchEngine.init_trackers", _log_on_every_rank,
        (f"{FLAGS}::test_tensorboard_holds_every_step_loss_and_the_config_in_one_file_from_rank_0",),
        "one writer: every rank starts the trackers and writes the same event files"),
    "adam-state-counted-once": Mutation(
        "toolkit.plan.memory", "optimizer_state", _adam_state_counted_once,
        (f"{PLAN}::test_the_optimizer_state_is_what_torch_keeps_after_a_step",),
        "the plan: AdamW's two moments counted as one state tensor, so a rank's predicted peak is too low"),
    "fsdp-share-not-divided": Mutation(
        "toolkit.plan.memory", "fsdp_share", _fsdp_share_whole,
        (f"{PLAN}::test_an_fsdp_rank_holds_the_share_the_plan_predicts",),
        "the plan: fsdp's per-rank share of the training state not divided by the ranks"),
    "all-reduce-costed-once": Mutation(
        "toolkit.plan.step_time", "all_reduce_seconds", _all_reduce_at_1x,
        (f"{PLAN}::test_an_all_reduce_costs_what_a_ring_sends[4]",),
        "the plan: an all-reduce costed at its bytes once, not the ring's 2(n-1)/n times them"),
    "config-overrides-later-flags": Mutation(
        "toolkit.config", "parse_config", _config_wins_over_later_flags,
        ("tests/test_config_file.py::test_flags_after_config_override_it_and_flags_before_it_do_not",),
        "a run from a file: a --config value overrides a flag given after it"),
    "pet-node-rank-as-rank": Mutation(
        "toolkit.launch.env", "_torchrun_group", _node_rank_as_rank,
        ("tests/test_clusters.py::test_kubeflow_trainer_nodes_start_torchrun_from_pet_variables_alone",),
        "Kubeflow: PET_NODE_RANK (the pod's node rank) read as the process's rank"),
    "ray-group-destroyed": Mutation(
        "toolkit.engines.group", "ProcessGroupMixin.end_training", _destroys_a_given_group,
        ("tests/test_ray.py::test_ray_workers_train_the_losses_of_two_torchrun_ranks_in_rays_group[auto]",),
        "Ray Train: the process group Ray made is destroyed at the end of training", needs="ray"),
}
