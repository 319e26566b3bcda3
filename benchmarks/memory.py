"""Training-state memory per rank: bytes of parameters, gradients and optimizer state under the ddp and fsdp
engines at world 2 and 4, next to the model's total; and activation memory with and without
--activation-checkpointing.

    python benchmarks/memory.py                  # resnet18 (11.2M parameters), AdamW, worlds 2 and 4, ~1 min
    python benchmarks/memory.py --model resnet9  # another model
    python benchmarks/memory.py --quick          # tiny, about 30 s
    python benchmarks/memory.py --quick --worlds 2   # tiny, world 2 only (what tests/test_benchmarks.py runs)
    python benchmarks/memory.py --meshes         # gpt-mini under tp=2, pp=2 (world 2) and tp=4 (world 4) vs ddp

For each world size W, W processes (torch.multiprocessing.spawn, gloo) build the toolkit's ddp and fsdp
engines on one group, prepare a copy of the same model with AdamW under each, and take one training step
(the optimizer creates its state on the first step). Each rank then sums the bytes of the tensors it holds:
its parameters, their .grad and the optimizer's state tensors; for a DTensor (FSDP) that is the local shard
(`to_local()`), padding included. Rank 0's totals are reported (the ranks differ by padding only).
Targets: fsdp per rank <= 0.55 x ddp at world 2 and <= 0.30 x ddp at world 4; the ratio lines print
ddp / fsdp, so each target is a least value (1 / 0.55 and 1 / 0.30). Activations and communication buffers
are not counted there: they depend on the batch, not on how the state is sharded.

With --meshes, the model is the LM recipe's gpt-mini (4 blocks, 4 heads) at width 512 (13M parameters, so that
the training state weighs as it does where model parallel is used; --quick: 128) and the same global batch of 8 sequences of
64 characters (AdamW) runs one `forward_backward` and one optimizer step under ddp and under the fsdp engine's
model-parallel meshes: tp=2 and pp=2 at world 2, tp=4 at world 4 (each a mesh with dp_shard 1, so only the model
split differs from ddp). Each rank counts what it holds as above, plus its activations: the peak of the bytes saved
for backward that are alive at once during the step (`saved_tensors_hooks`, each storage counted while a tensor on
it is saved; a pipeline's 1F1B frees a micro-batch's after its backward). The largest rank's figures are reported
(a pipeline's first and last stages hold the tied embedding). Targets: mesh / ddp bytes per rank at most 0.6 at
world 2 and 0.35 at world 4.

Activations are measured apart, in this process, on two copies of the same model, one with its blocks
checkpointed (`toolkit.models.blocks.checkpoint_blocks`, what --activation-checkpointing does): the bytes of
the tensors its forward saves for backward (`torch.autograd.graph.saved_tensors_hooks`, each storage once,
parameters left out), at batch 32 (--quick: 8) of 32x32 images. A checkpointed block saves only its input.
On a GPU the peak of `torch.cuda.max_memory_allocated` over forward and backward, above what the model and
batch hold, is reported too: it adds the gradients and one block's recomputation. Target: checkpointing
keeps at most half the plain model's saved bytes (the ratio prints plain / checkpointed, at least 2). tiny
has no block with layers inside, so there is nothing to checkpoint and no ratio.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import warnings
import weakref
from pathlib import Path

import common
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models.blocks import checkpoint_blocks
from toolkit.models.nets import MODELS, build_model

TARGETS = {2: 0.55, 4: 0.30}  # fsdp bytes per rank / ddp bytes per rank, at most
ACTIVATION_TARGET = 2.0  # plain saved bytes / checkpointed saved bytes, at least
KINDS = ("parameters", "gradients", "optimizer state")


def parse_args(argv=None):
    parser = common.build_parser("memory", __doc__)
    parser.add_argument("--model", default=None, choices=sorted(MODELS), help="default resnet18; --quick: tiny")
    parser.add_argument("--worlds", default="2,4", help="world sizes to measure, from 2 and 4 (default both)")
    parser.add_argument("--meshes", action="store_true", help="gpt-mini under tp and pp meshes against ddp instead")
    args = parser.parse_args(argv)
    worlds = [w.strip() for w in args.worlds.split(",") if w.strip()]
    if not worlds or any(w not in ("2", "4") for w in worlds):
        raise UserError(f"--worlds takes 2, 4 or 2,4 (got {args.worlds}).")
    args.worlds = [int(w) for w in worlds]
    args.model = args.model or ("tiny" if args.quick else "resnet18")
    return args


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: only this rank's shard is in its memory
        total += t.numel() * t.element_size()
    return total


def held(model, optimizer) -> dict:
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {"parameters": local_bytes(model.parameters()), "gradients": local_bytes(p.grad for p in model.parameters()),
            "optimizer state": local_bytes(state)}


def one_step(accelerator, model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(accelerator.process_index)
    x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 10, (4,), generator=g)
    accelerator.backward(F.cross_entropy(model(x), y))
    optimizer.step()  # gradients are kept (no zero_grad): they are part of what a step holds at its peak
    return held(accelerator.unwrap_model(model), optimizer.optimizer)


def worker(rank: int, world: int, model_name: str, port: int, result_path: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from toolkit.engines.ddp import RawDDPEngine
    from toolkit.engines.fsdp import FSDPEngine
    from toolkit.launch.env import read_launch_env

    env = read_launch_env()
    ddp = RawDDPEngine(env)  # forms the group; the fsdp engine joins it
    fsdp = FSDPEngine(env)
    torch.manual_seed(0)
    base = build_model(model_name, 10)
    result = {"total": local_bytes(base.parameters()), "ddp": one_step(ddp, copy.deepcopy(base)),
              "fsdp": one_step(fsdp, copy.deepcopy(base))}
    if rank == 0:
        Path(result_path).write_text(json.dumps(result))
    ddp.end_training()


def spawned(function, world: int, *args) -> dict:
    """What rank 0 of `world` processes running function(rank, world, *args, port, result path) wrote."""
    from toolkit.launch.launcher import free_port

    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(function, args=(world, *args, free_port(), path), nprocs=world, join=True)
        return json.loads(Path(path).read_text())


def saved_bytes(model, x) -> int:
    """Bytes of the tensors `model(x)`'s forward saves for its backward: each storage once, parameters not
    counted (they are held with or without a backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    return sum(seen.values())


def cuda_peak_bytes(model, x) -> int:
    """Peak CUDA memory over one forward and backward, above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    F.cross_entropy(model(x), torch.zeros(len(x), dtype=torch.long, device=x.device)).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def activations(model_name: str, batch: int) -> dict:
    """Saved bytes (and on a GPU, peak bytes) of the same model plain and with its blocks checkpointed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    plain = build_model(model_name, 10).to(device)
    checkpointed = copy.deepcopy(plain)
    blocks = len(checkpoint_blocks(checkpointed))
    x = torch.randn(batch, 3, 32, 32, device=device)
    result = {"blocks": blocks, "saved": {name: saved_bytes(m, x) for name, m in
                                          (("plain", plain), ("checkpointed", checkpointed))}}
    if device.type == "cuda":
        result["peak"] = {name: cuda_peak_bytes(m, x) for name, m in (("plain", plain), ("checkpointed", checkpointed))}
    return result


MESH_TARGETS = {2: 0.6, 4: 0.35}  # a model-parallel mesh's bytes per rank / ddp's, at most
MESHES = {2: {"tp=2": {"tp_size": 2}, "pp=2": {"pp_size": 2}}, 4: {"tp=4": {"tp_size": 4}}}
MESH_KINDS = KINDS + ("activations",)


class LiveSaved:
    """The peak bytes of tensors saved for backward that are alive at once: a saved tensor's storage counts from
    its save until the autograd graph drops it (after its backward)."""

    def __init__(self, skip):
        self.skip, self.live, self.peak, self.count = skip, {}, 0, {}

    def pack(self, tensor):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = local.untyped_storage().data_ptr()
        if key not in self.skip:
            if key not in self.live:
                self.live[key] = local.untyped_storage().nbytes()
            self.count[key] = self.count.get(key, 0) + 1
            weakref.finalize(tensor, self._dropped, key)
            self.peak = max(self.peak, sum(self.live.values()))
        return tensor

    def _dropped(self, key):
        self.count[key] -= 1
        if not self.count[key]:
            self.live.pop(key, None)


def next_token_loss(logits, targets):  # recipes/lm.py's
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def mesh_step(accelerator, model) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    readers, index = accelerator.data_parallel_size, accelerator.data_parallel_index
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 60, (8, 64), generator=g), torch.randint(0, 60, (8, 64), generator=g)
    share = slice(index * 8 // readers, (index + 1) * 8 // readers)  # the same global batch on every mesh
    saved = LiveSaved({p.to_local().untyped_storage().data_ptr() if hasattr(p, "to_local") else
                       p.untyped_storage().data_ptr() for p in model.parameters()})
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        accelerator.forward_backward(model, x[share], y[share], next_token_loss)
    optimizer.step()
    return {**held(accelerator.unwrap_model(model), optimizer.optimizer), "activations": saved.peak}


def mesh_worker(rank: int, world: int, width: int, port: int, result_path: str):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from toolkit import ParallelismConfig
    from toolkit.engines.ddp import RawDDPEngine
    from toolkit.engines.fsdp import FSDPEngine
    from toolkit.launch.env import read_launch_env
    from toolkit.models.gpt import build_gpt

    # Under the saved-tensor hooks, FSDP2 sees the embedding's output as a view and warns that an in-place op on it
    # would skip its hook; the GPT adds to it out of place (the recipe's runs, without these hooks, do not warn).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    env = read_launch_env()
    ddp = RawDDPEngine(env)  # forms the group; each mesh's fsdp engine joins it
    torch.manual_seed(0)
    base = build_gpt("gpt-mini", 60, n_embd=width)
    mine = {"ddp": mesh_step(ddp, copy.deepcopy(base))}
    for name, sizes in MESHES[world].items():
        engine = FSDPEngine(env, parallelism_config=ParallelismConfig(**sizes), checkpoint_format="sharded")
        mine[name] = mesh_step(engine, copy.deepcopy(base))
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:  # the largest rank's bytes of each kind, setup by setup
        result = {"total": local_bytes(base.parameters()),
                  **{name: {kind: max(r[name][kind] for r in every) for kind in MESH_KINDS} for name in mine}}
        Path(result_path).write_text(json.dumps(result))
    ddp.end_training()


def main_meshes(args, out) -> int:
    rows, ratios, notes = [], [], []
    width = 128 if args.quick else 512
    for world in args.worlds:
        result = spawned(mesh_worker, world, width)
        ddp = sum(result["ddp"].values())
        for name in ["ddp", *MESHES[world]]:
            total = sum(result[name].values())
            rows.append([f"{name} x {world}", *(f"{mib(result[name][k]):.3f}" for k in MESH_KINDS),
                         f"{mib(total):.3f}", f"{total / ddp:.3f}"])
            if name != "ddp":
                target = MESH_TARGETS[world]
                ratios.append(common.Ratio(f"gpt-mini-{width} ddp / {name} per rank", ddp / total,
                                           round(1 / target, 3)))
                notes.append(f"{name}: {total / ddp:.3f} x ddp's bytes per rank (target <= {target}): "
                             f"{'reached' if total / ddp <= target else 'missed'}.")
    columns = ["setup x world", *(f"{k} MiB" for k in MESH_KINDS), "sum MiB per rank", "sum / ddp's"]
    bars = common.Bars([r[0] for r in rows], [float(r[5]) for r in rows], "MiB per rank (training state + "
                       "activations)", [f"{r[6]}x" for r in rows])
    title = (f"Memory per rank: ddp vs tensor and pipeline parallel (gpt-mini at width {width}, AdamW, 8 x 64 "
             f"characters per step)")
    common.publish(out, "memory", title, (columns, rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


def mib(n: int) -> float:
    return n / 2**20


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    if args.meshes:
        return main_meshes(args, out)
    rows, ratios, notes = [], [], []
    for world in args.worlds:
        target = TARGETS[world]
        result = spawned(worker, world, args.model)
        sums = {engine: sum(result[engine].values()) for engine in ("ddp", "fsdp")}
        for engine in ("ddp", "fsdp"):
            rows.append([f"{engine} x {world}", *(f"{mib(result[engine][k]):.2f}" for k in KINDS),
                         f"{mib(sums[engine]):.2f}", f"{mib(result['total']):.2f}",
                         f"{sums[engine] / sums['ddp']:.3f}"])
        ratios.append(common.Ratio(f"{args.model} ddp / fsdp per rank, world {world}", sums["ddp"] / sums["fsdp"],
                                   round(1 / target, 3)))
        notes.append(f"world {world}: fsdp holds {sums['fsdp'] / sums['ddp']:.3f} x ddp's bytes per rank "
                     f"(target <= {target}).")
    batch = 8 if args.quick else 32
    acts = activations(args.model, batch)
    saved = acts["saved"]
    if acts["blocks"]:
        ratios.append(common.Ratio(f"{args.model} saved activations plain / checkpointed",
                                   saved["plain"] / saved["checkpointed"], ACTIVATION_TARGET))
        notes.append(f"activations saved for backward, {args.model} at batch {batch}: {mib(saved['plain']):.1f} MiB "
                     f"plain, {mib(saved['checkpointed']):.1f} MiB with its {acts['blocks']} blocks checkpointed "
                     f"({saved['checkpointed'] / saved['plain']:.3f} x).")
    else:
        notes.append(f"{args.model} has no block with layers inside: nothing to checkpoint "
                     f"({mib(saved['plain']):.2f} MiB saved for backward at batch {batch}).")
    if "peak" in acts:
        peak = acts["peak"]
        notes.append(f"CUDA peak over forward and backward, {args.model} at batch {batch}: "
                     f"{mib(peak['plain']):.1f} MiB plain, {mib(peak['checkpointed']):.1f} MiB checkpointed "
                     f"({peak['checkpointed'] / peak['plain']:.3f} x).")
    columns = ["engine x world", "parameters MiB", "gradients MiB", "optimizer state MiB", "sum MiB per rank",
               "model parameters MiB (whole)", "sum / ddp's"]
    bars = common.Bars([r[0] for r in rows], [float(r[4]) for r in rows], "MiB per rank (parameters + gradients + "
                       "AdamW state)", [f"{r[6]}x" for r in rows])
    title = f"Training-state memory per rank: ddp vs fsdp ({args.model}, AdamW); activations, checkpointed or not"
    common.publish(out, "memory", title, (columns, rows), ratios, notes, bars)
    return common.exit_code(ratios, args.quick)


if __name__ == "__main__":
    common.run_main(main)
