"""Under Ray Train (toolkit/launch/ray_train.py), the run's checkpoints and figures go to Ray as well, through
`ray.train.report`: Ray copies each reported checkpoint folder into its storage (RunConfig.storage_path) and, when a
worker fails, restarts every worker with `ray.train.get_checkpoint()` the last one, which the run resumes from.

Ray's report is a barrier: every worker calls it as often as the others, which both calls here do (a checkpoint
is saved, and the run finished, on every rank). Only the main process hands over the folder and Ray keeps rank 0's
figures. Elsewhere (torchrun, accelerate launch, python, ...) both are no-ops.
"""

from __future__ import annotations


def report_checkpoint(run, folder) -> None:
    """After `checkpoint_saved(folder)`: the folder and the position it holds."""
    if run.env.launcher != "ray":
        return
    import ray.train

    main = run.accelerator.is_main_process
    ray.train.report({"step": run.step, "epoch": run.epoch},
                     checkpoint=ray.train.Checkpoint.from_directory(str(folder)) if main else None)


def report_summary(run, summary: dict) -> None:
    """After summary.json: the run's final figures with its latest checkpoint, again. Ray Train's Result holds the
    figures of the last report that carried a checkpoint (`result.metrics` beside `result.checkpoint`); figures
    reported alone are not kept, so the latest checkpoint is handed over once more (Ray copies it again)."""
    if run.env.launcher != "ray":
        return
    import ray.train

    from toolkit.checkpoint.functional import latest_checkpoint

    latest = latest_checkpoint(run.checkpoints) if run.accelerator.is_main_process else None
    ray.train.report({key: summary[key] for key in ("steps", "test_accuracy", "test_loss", "images_per_s",
                                                    "world_size", "global_batch_size") if key in summary},
                     checkpoint=ray.train.Checkpoint.from_directory(str(latest)) if latest else None)
