"""`toolkit checkpoint consolidate`: a sharded checkpoint (--checkpoint-format sharded) turned, in one process
and without a process group, into the full format that resumes under every engine, or into the weights alone.

    >>> consolidate("runs/x/checkpoints", "runs/x/full")
    PosixPath('runs/x/full/step-00000012')
"""

from pathlib import Path

from toolkit.errors import UserError
from toolkit.engines.state_folder import RNG_FILE, load_safe, rng_file
from toolkit.models.weights import save_model
from toolkit.train.checkpoint import save_checkpoint
from toolkit.train.checkpoint_files import STATE_FILES, _resolve_checkpoint, checkpoint_format, read_state
from toolkit.train.sharded_checkpoint import SafeEmptyPlanner, read_pieces


def consolidate(path, out) -> Path:
    """Turn a sharded checkpoint (a step folder, or the latest under a root) into a full one, in one process
    without a process group: `out` ending in .safetensors gets the weights alone, any other `out` becomes a
    checkpoints root holding `step-N/` in the full format (model.safetensors, optimizer.bin in torch's layout,
    scheduler, RNG, state), which resumes under every engine at any world size.

    >>> consolidate("runs/x/checkpoints", "runs/x/full")
    PosixPath('runs/x/full/step-00000012')
    """
    return _consolidate_verified(_resolve_checkpoint(Path(path)), Path(out))


def _consolidate_verified(path, out):
    if checkpoint_format(path) != "sharded":
        raise UserError(f"{path} is already a full checkpoint: its weights are {path / 'model.safetensors'}.")
    planner = SafeEmptyPlanner()  # rebuilds every tensor, whole, from the index (DCP's dcp_to_torch_save way)
    read_pieces({}, path, planner, no_dist=True)
    whole = planner.original_state_dict
    weights = whole["model"]
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        save_model(weights, out)
        return out
    stateful = {name: load_safe(path / STATE_FILES[name]) for name in ("scheduler", "scaler")
                if (path / STATE_FILES[name]).is_file()}
    ranks = sorted(int(m[1]) for p in path.iterdir() if (m := RNG_FILE.fullmatch(p.name)))
    rng_states = [load_safe(path / rng_file(rank)) for rank in ranks]
    state = read_state(path)
    return save_checkpoint(out, int(state["step"]), model=weights, optimizer=_torch_layout(whole.get("optim")),
                           state=state, rng_states=rng_states, **stateful)


def _torch_layout(optimizer_state):
    """An optimizer state keyed by parameter name (DCP's) in torch's own layout: keyed by index in group order."""
    if optimizer_state is None:
        return None
    names = [name for group in optimizer_state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in optimizer_state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in optimizer_state["param_groups"]]}


def run_consolidate(args) -> int:
    """`toolkit checkpoint consolidate CHECKPOINT [--out PATH]`."""
    source = _resolve_checkpoint(Path(args.checkpoint))
    out = Path(args.out) if args.out else source.parent.with_name(source.parent.name + "-full")
    written = _consolidate_verified(source, out)  # verified once: hashing every shard again would double the reads
    ranks = len([f for f in source.iterdir() if f.suffix == ".distcp"])
    then = "" if written.suffix == ".safetensors" else f"; resume with --resume {written}"
    print(f"wrote {written}: the full weights of {source}, from {ranks} rank(s)' shards{then}")
    return 0
