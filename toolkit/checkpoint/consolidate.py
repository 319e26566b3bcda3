"""`toolkit checkpoint consolidate`: a sharded checkpoint (--checkpoint-format sharded) turned, in one process
and without a process group, into the full format that resumes under every engine, or into the weights alone.

    consolidate("runs/x/checkpoints", "runs/x/full")     # -> runs/x/full/step-00000012
"""

from pathlib import Path

from toolkit.errors import UserError
from toolkit.checkpoint.sharded import read_whole
from toolkit.checkpoint.folder import STEP_FOLDER, checkpoint_format, finish_checkpoint, resolve_checkpoint
from toolkit.checkpoint.state import write_consolidated
from toolkit.checkpoint.weights import save_model


def consolidate(path, out) -> Path:
    """Turn a sharded checkpoint (a step folder, or the latest under a root) into a full one, in one process
    without a process group: `out` ending in .safetensors gets the first model's weights alone; any other `out`
    becomes a checkpoints root holding the folder, of the same name, in the full format (model.safetensors,
    optimizer.bin in torch's layout, and every other file as it was), which resumes under every engine at any
    world size. Returns what it wrote."""
    return _consolidate_verified(resolve_checkpoint(path), Path(out))


def _consolidate_verified(path, out):
    if checkpoint_format(path) != "sharded":
        raise UserError(f"{path} is already a full checkpoint: its weights are {path / 'model.safetensors'}.")
    models, optimizers = read_whole(path)  # before anything is written: a damaged shard leaves no output
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_model(models[0], out)
        return out
    final = out / path.name
    write_consolidated(final, path, models, [_torch_layout(state) for state in optimizers])
    if STEP_FOLDER.fullmatch(final.name):
        finish_checkpoint(out, final)
    return final


def _torch_layout(optimizer_state):
    """An optimizer state keyed by parameter name (DCP's) in torch's own layout: keyed by index in group order."""
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]]}


def run_consolidate(args) -> int:
    """`toolkit checkpoint consolidate CHECKPOINT [--out PATH]`."""
    source = resolve_checkpoint(args.checkpoint)
    out = Path(args.out) if args.out else source.parent.with_name(source.parent.name + "-full")
    written = _consolidate_verified(source, out)  # verified once: hashing every shard again would double the reads
    ranks = len([f for f in source.iterdir() if f.suffix == ".distcp"])
    then = "" if written.suffix == ".safetensors" else f"; resume with --resume {written}"
    print(f"wrote {written}: the full weights of {source}, from {ranks} rank(s)' shards{then}")
    return 0
