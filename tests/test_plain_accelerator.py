"""The recipes' parts (TrainingRun, run_guard, the loaders and evaluation of recipes/cifar.py) over Accelerate's own
`Accelerator`, as a user's Accelerate script holds them: they read nothing but the Accelerator API, so they train
exactly as over the toolkit's engine, and resume from what that Accelerator's `save_state` wrote."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from conftest import read_json

import toolkit
from recipes import cifar
from toolkit.data import load_data
from toolkit.models.nets import build_model
from toolkit.checkpoint.functional import latest_checkpoint
from toolkit.train import (TrainingRun, apply_preset, build_optimizer, decay_groups, lr_schedule, plan_batches,
                           run_guard)

STEPS = 6  # tiny's preset global batch 64 over the 5000 synthetic images: 78 steps to an epoch, 6 of them here


def train(accelerator, out, *flags) -> tuple[list[float], dict, object]:
    """cifar.py's main() from its accelerator on (the parts it calls, in its order), for STEPS steps with a checkpoint
    every 2; returns (the step losses, the final weights, what resume_folder said)."""
    cfg, _ = apply_preset(toolkit.parse_config(cifar.Config, [str(arg) for arg in (
        "--dataset", "synthetic", "--model", "tiny", "--max-steps", STEPS, "--checkpoint-every", 2, "--seed", 3,
        "--global-batch-size", 32, "--micro-batch-size", 16, "--output-dir", out, *flags)]))
    plan = plan_batches(cfg.global_batch_size, accelerator.num_processes, cfg.micro_batch_size)
    accelerator.gradient_accumulation_steps = plan.accumulation
    set_seed(cfg.seed)
    data = load_data(cfg.dataset, cfg.data_dir, cfg.seed)
    train_loader, test_loader = cifar.build_loaders(cfg, data, accelerator, plan.micro_batch)
    model = build_model(cfg.model, data.num_classes)
    optimizer = build_optimizer(cfg.optimizer, decay_groups(model, cfg.weight_decay), lr=cfg.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    run = TrainingRun(accelerator, cfg, plan, batches_per_epoch=len(train_loader))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg.schedule, run.total_steps, cfg.warmup))
    checkpointed = [scheduler, run]
    accelerator.register_for_checkpointing(*checkpointed)
    resume = run.resume_folder(model, optimizer, checkpointed)
    if resume.action == "load_state":
        accelerator.load_state(resume.folder)
    losses = []
    with run_guard(run) as guard:
        for _ in run.epochs():
            for images, labels in run.batches(train_loader):
                with accelerator.accumulate(model):
                    loss = F.cross_entropy(model(images), labels)
                    if guard.should_backward(loss):
                        accelerator.backward(loss)
                    guard.check()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if accelerator.sync_gradients:
                    scheduler.step()
                    losses.append(run.step_done(lr=scheduler.get_last_lr()[0], **guard.step_done())["loss"])
                    if run.checkpoint_due():
                        run.checkpoint_saved(accelerator.save_state(run.checkpoint_folder()))
    run.finish(cifar.evaluate(model, test_loader, accelerator, data.num_classes))
    accelerator.end_training()
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return losses, weights, resume


def test_the_cifar_recipes_parts_train_over_accelerates_own_accelerator_as_over_the_engine(tmp_path):
    engine_losses, engine_weights, _ = train(toolkit.build_accelerator("single"), tmp_path / "engine")
    plain_losses, plain_weights, resume = train(Accelerator(cpu=True), tmp_path / "plain")
    assert resume.action == "start" and len(plain_losses) == STEPS
    assert plain_losses == engine_losses  # the same kernels in the same order: equal, not close
    assert all(torch.equal(plain_weights[k], engine_weights[k]) for k in engine_weights)
    summaries = [read_json(tmp_path / name / "summary.json") for name in ("engine", "plain")]
    assert [s["engine"] for s in summaries] == ["single", "accelerate"] and summaries[0]["steps"] == STEPS
    assert summaries[1]["test_accuracy"] == summaries[0]["test_accuracy"]


def test_a_plain_accelerators_save_state_resumes_the_run_where_it_stopped(tmp_path):
    """Its step-2 folder (Accelerate's files, the run's position in custom_checkpoint_1.pkl, no state.json), which
    the run sealed once written (a manifest of the files' sizes and sha256s, as the engines write), resumes through
    load_state: steps 3 to 6 lose and end as the uninterrupted run did; `latest` names the last step folder."""
    losses, weights, _ = train(Accelerator(cpu=True), tmp_path / "whole")
    step_2 = tmp_path / "whole" / "checkpoints" / "step-00000002"
    assert not (step_2 / "state.json").exists() and (step_2 / "custom_checkpoint_1.pkl").is_file()
    manifest = read_json(step_2 / "manifest.json")
    assert set(manifest["files"]) == {p.name for p in step_2.iterdir()} - {"manifest.json"}
    assert latest_checkpoint(tmp_path / "whole" / "checkpoints").name == f"step-{STEPS:08d}"
    resumed_losses, resumed_weights, resume = train(Accelerator(cpu=True), tmp_path / "resumed", "--resume", step_2)
    assert (resume.action, resume.folder) == ("load_state", step_2)
    assert resumed_losses == losses[2:]
    assert all(torch.equal(resumed_weights[k], weights[k]) for k in weights)
