"""A run's attempts: each launch or restart that trained part of the run keeps its figures in summary.json's
`attempts` (steps, world, plan, rate). What follows from the list: the resumes onto another world, the line such a
resume says, the rate over every attempt, and the restart count every rank agrees on.
"""

from __future__ import annotations


def world_changes(attempts: list[dict]) -> list[dict]:
    """Each resume onto another number of processes: at which step, from what world to what, and the accumulation
    the plan derived for the new world (the global batch stays the run's).

    >>> world_changes([{"to_step": 37, "world_size": 4, "nodes": 2, "accumulation": 1},
    ...                {"from_step": 35, "world_size": 2, "nodes": 1, "accumulation": 2}])
    [{'step': 35, 'old_world': 4, 'new_world': 2, 'old_nodes': 2, 'new_nodes': 1, 'accumulation': 2}]
    """
    return [{"step": now["from_step"], "old_world": before["world_size"], "new_world": now["world_size"],
             "old_nodes": before.get("nodes"), "new_nodes": now.get("nodes"), "accumulation": now.get("accumulation")}
            for before, now in zip(attempts, attempts[1:]) if before.get("world_size") != now.get("world_size")]


def world_change_line(before: dict, now: dict, plan) -> str:
    """The one line a resume onto another world says.

    >>> from toolkit.train import plan_batches
    >>> world_change_line({"world_size": 4, "nodes": 2, "to_step": 37}, {"world_size": 2, "nodes": 1,
    ...                   "from_step": 35}, plan_batches(128, 2, 32))
    '[toolkit] 2 nodes -> 1 (4 -> 2 processes) at step 35: continuing with accumulation 2 of micro-batch 32 per process, the same global batch 128'
    """
    nodes = (f"{before['nodes']} node{'s' * (before['nodes'] != 1)} -> {now['nodes']} "
             if before.get("nodes") and before.get("nodes") != now.get("nodes") else "")
    world = f"{before['world_size']} -> {now['world_size']} processes"
    return (f"[toolkit] {nodes}{f'({world})' if nodes else world} at step {now['from_step']}: continuing with "
            f"accumulation {plan.accumulation} of micro-batch {plan.micro_batch} per process, the same global batch "
            f"{plan.global_batch}")


def overall_rate(attempts: list[dict], global_batch: int) -> float | None:
    """Samples per second over every attempt that measured one: each attempt's rate weighted by its time.

    >>> overall_rate([{"from_step": 0, "to_step": 10, "images_per_s": 100.0},
    ...               {"from_step": 10, "to_step": 30, "images_per_s": 400.0}], global_batch=10)
    200.0
    """
    timed = [(a["to_step"] - a["from_step"]) * global_batch for a in attempts if a.get("images_per_s")]
    seconds = sum(n / a["images_per_s"] for n, a in zip(timed, (a for a in attempts if a.get("images_per_s"))))
    return round(sum(timed) / seconds, 1) if seconds > 0 else None


def agreed_restart_count(accelerator, mine: int) -> int:
    """How often torchrun (or toolkit launch) restarted the job, the same on every rank: the highest count any
    rank was started with (`mine`: this rank's, LaunchEnv.restart_count) (a node whose own workers did not fail re-joins with its count unchanged)."""
    import torch

    counts = accelerator.gather(torch.tensor([mine], device=accelerator.device))
    return int(counts.max())
