"""Run the conformance parts under engines in turn, in one process (or one torchrun launch), so that process
starts are shared: Accelerate's own no_sync tests, set_seed(device_specific=True), a split_batches loader,
gradient_accumulation.py, checkpointing.py (uninterrupted; interrupted after step 6; resumed in a fresh
Accelerator), state_roundtrip.py (save, then load the folders of --load-from) and, last, tracking.py: a real
Accelerator's end_training destroys the process group the others share. tests/test_accelerate_conformance.py
reads what they write.

    python tests/scripts/conformance/driver.py --out /tmp/w1 --engines single dp ddp fsdp accelerate real --load-all
    torchrun --nproc_per_node 2 tests/scripts/conformance/driver.py --out /tmp/w2 --engines ddp --load-from real ddp
    torchrun --nproc_per_node 2 tests/scripts/conformance/driver.py --out /tmp/w2 --engines real --phase load \
        --load-from ddp

Everything for engine E lands in OUT/E/. A part that raises is written down (OUT/E/errors-<rank>.json: part ->
traceback, or null when it ran through) and the next part runs: one broken call does not hide the others.
"""

import argparse
import datetime
import json
import os
import traceback
from argparse import Namespace
from pathlib import Path

import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs

import checkpointing
import gradient_accumulation
import state_roundtrip
import tracking
from toy_task import SEED, build_accelerator, write_json

RANK = int(os.environ.get("RANK", 0))
# A part that fails on one process only leaves the other waiting in a collective: it fails too, not hangs.
COLLECTIVE_TIMEOUT = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=90))


def fresh_accelerate_state(world_too: bool = False):
    """Each script as if in a process of its own: Accelerate's singletons forgotten (the process group kept,
    unless `world_too`: then the next Accelerator forms its world again)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=world_too)
    GradientState._reset_state()
    if world_too:
        PartialState._reset_state()


def sync_tests(accelerator):
    from accelerate.test_utils.scripts.test_sync import (test_distributed_sync, test_distributed_sync_multiple_fwd,
                                                         test_noop_sync)
    import functools

    from accelerate.test_utils.scripts import test_sync
    from accelerate.test_utils.training import RegressionDataset

    # Accelerate's tests draw their data from np.random.default_rng(None): a fresh draw per run, and on some draws
    # torch.allclose's default tolerance fails the real Accelerator itself (1.2e-7 apart, seen once in CI).
    test_sync.RegressionDataset = functools.partial(RegressionDataset, seed=SEED)

    if accelerator.num_processes == 1:
        return {"test_noop_sync": run_part(lambda: test_noop_sync(accelerator))}
    return {"test_distributed_sync": run_part(lambda: test_distributed_sync(accelerator)),
            "test_distributed_sync_multiple_fwd": run_part(lambda: test_distributed_sync_multiple_fwd(accelerator))}


def seeds_each_process_apart(accelerator):
    """Accelerate's set_seed(seed, device_specific=True), called after the Accelerator is built, as Accelerate
    asks: each process seeded with seed + its index."""
    import torch
    from accelerate.utils import set_seed

    set_seed(SEED, device_specific=True)
    assert torch.initial_seed() == SEED + accelerator.process_index, torch.initial_seed()


def split_batches_order(engine, out: Path):
    """The samples of each global batch with `DataLoaderConfiguration(split_batches=True)`: the loader's
    batch_size is then the global batch, which the processes split between them."""
    import torch
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    accelerator = build_accelerator(engine, cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    loader = accelerator.prepare(DataLoader(torch.arange(32), batch_size=8))
    batches = [sorted(accelerator.gather(batch).tolist()) for batch in loader]
    if accelerator.is_main_process:
        write_json(out / "split_batches.json", batches)


def released(accelerator):
    assert not dist.is_initialized(), f"{accelerator.name}: the process group outlived end_training"


def run_part(function):
    """None when `function` ran through, else its traceback."""
    try:
        function()
        return None
    except BaseException:  # noqa: BLE001 -- an assertion or an error: both are the part's result
        return traceback.format_exc()


def checkpointing_runs(engine, out: Path):
    """Uninterrupted; interrupted after step 6 (mid-epoch 1); resumed in a fresh Accelerator from the latest."""
    runs = {"uninterrupted": ("uninterrupted", None, False), "interrupted": ("resuming", 6, False),
            "resumed": ("resuming", None, True)}
    errors = {}
    for name, (project, stop, resume) in runs.items():
        args = Namespace(engine=engine, project_dir=str(out / "checkpointing" / project),
                         output_dir=str(out / "checkpointing" / name), checkpointing_steps=2, stop_after_step=stop,
                         resume_from_checkpoint=resume)
        errors[f"checkpointing.{name}"] = run_part(lambda: checkpointing.training_function(checkpointing.CONFIG, args))
        fresh_accelerate_state()
    return errors


def run_engine(engine, phase, out: Path, load_from: list, root: Path):
    errors = {}
    keeper = build_accelerator(engine, cpu=True, kwargs_handlers=[COLLECTIVE_TIMEOUT])  # forms the shared group
    if phase == "all":
        errors.update(sync_tests(keeper))
        errors["set_seed.device_specific"] = run_part(lambda: seeds_each_process_apart(keeper))
        fresh_accelerate_state()
        errors["split_batches"] = run_part(lambda: split_batches_order(engine, out))
        fresh_accelerate_state()
        args = Namespace(engine=engine, output_dir=str(out / "gradient_accumulation"))
        errors["gradient_accumulation"] = run_part(
            lambda: gradient_accumulation.training_function(gradient_accumulation.CONFIG, args))
        fresh_accelerate_state()
        errors.update(checkpointing_runs(engine, out))
        errors["state.save"] = run_part(lambda: state_roundtrip.save(engine, str(out / "state"), str(out / "saved.json")))
        fresh_accelerate_state()
    for saver in load_from:
        errors[f"state.load.{saver}"] = run_part(lambda: state_roundtrip.load(
            engine, str(root / saver / "state"), str(out / "loaded" / f"{saver}.json")))
        fresh_accelerate_state()
    if phase == "all":  # last: a real Accelerator's end_training destroys the process group
        args = Namespace(engine=engine, project_dir=str(out / "tracking" / "project"),
                         output_dir=str(out / "tracking" / "weights"))
        errors["tracking"] = run_part(lambda: tracking.training_function(tracking.CONFIG, args))
    if engine in ("real", "accelerate"):
        if dist.is_initialized():
            dist.destroy_process_group()
        fresh_accelerate_state(world_too=True)
    else:
        keeper.end_training()  # the owner of the group releases it: the next engine forms its own
        errors["end_training.releases_group"] = run_part(lambda: released(keeper))
    path = out / f"errors-{RANK}.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**previous, **errors}, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", nargs="+", required=True)
    parser.add_argument("--phase", choices=("all", "load"), default="all")
    parser.add_argument("--load-from", nargs="*", default=[], help="engines whose saved folders to load")
    parser.add_argument("--load-all", action="store_true", help="then load every engine's folder under each")
    args = parser.parse_args()
    root = Path(args.out)
    for engine in args.engines:
        (root / engine).mkdir(parents=True, exist_ok=True)
        run_engine(engine, args.phase, root / engine, args.load_from, root)
    if args.load_all:
        for engine in args.engines:
            run_engine(engine, "load", root / engine, args.engines, root)


if __name__ == "__main__":
    main()
