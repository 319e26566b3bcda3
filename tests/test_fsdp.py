"""The fsdp engine (FSDP2 on gloo), as a user meets it: training equal to a plain one-process PyTorch loop,
full checkpoints that resume under every other engine and back, `toolkit parity` against ddp and one
process, and the FSDP profile never training as DDP without a word.

Launches are shared: one 2-rank script checks the engine against its reference (tests/scripts/fsdp_check.py),
one 2-rank recipe run is the trajectory that every resumed run is compared with, and one more 2-rank run saves
sharded checkpoints (--checkpoint-format sharded) that one process resumes (in-process cases of bad sharded
checkpoints: tests/test_sharded_checkpoint.py).
"""

import json
import subprocess

import pytest
import safetensors.torch
import torch
from conftest import ACCELERATE, CONFIGS, PY, ROOT, SCRIPTS, TOOLKIT, TORCHRUN, final_weights, max_weight_diff, read_json, run

from toolkit.launch.launcher import free_port

CIFAR = ROOT / "recipes" / "cifar.py"
CPU = CONFIGS / "cpu.yaml"
# fp32 rounding of a mean over 2 x 4 samples vs 8, measured 1.5e-8 on weights and norms: 1e-6 leaves room, and
# a real bug (a skipped gradient division, rank-specific initial weights) moves them by 1e-2 or more.
TIGHT = 1e-6


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "check.json"
    run(TORCHRUN + ["--master_port", free_port(), SCRIPTS / "fsdp_check.py", "--out", out], timeout=240)
    return read_json(out)


def test_training_with_accumulation_and_clipping_equals_a_plain_loop(check):
    assert check["world"] == 2
    assert max(check["weight_diffs"]) <= TIGHT, check["weight_diffs"]
    assert max(abs(a - b) for a, b in zip(check["norms"], check["ref_norms"])) <= TIGHT
    assert max(check["ref_norms"]) > 0.3  # the clip really cut (MAX_NORM in the script)


def test_each_rank_holds_about_half_the_parameters(check):
    # Padding: output sizes 7 and 3 shard as 4+3 and 2+1, so rank 0 holds a little over half.
    assert check["full_numel"] / 2 <= check["local_numel"] <= check["full_numel"] / 2 + 16


def test_non_final_micro_steps_skip_the_reduce_scatter(check):
    assert check["grad_none_before_sync"] == [True] * 3  # no sharded gradient exists before the last micro-step
    assert check["dtensor_grads_at_sync"] == [True] * 3


def test_model_no_sync_accumulates_as_on_ddp_and_reduces_once_per_optimizer_step(check):
    """Accelerate's example gradient_accumulation_for_autoregressive_models.py accumulates with model.no_sync()."""
    assert check["no_sync_grad_none"] == [True]  # the backward inside no_sync reduce-scattered nothing
    # the step equals one process's on the whole global batch: measured 2.3e-10 (avx2) and 4.7e-10 (default kernels)
    assert check["no_sync_diff"] <= TIGHT


def test_full_state_dicts_round_trip_in_torch_layout(check):
    assert check["opt_groups_equal"] and check["opt_state_diff"] <= TIGHT
    assert check["resumed_diff"] <= TIGHT  # a fresh sharded model loaded the full state and stepped like the reference


def test_a_sharded_save_rank_0_cannot_start_stops_every_rank_at_once(check):
    assert check["blocked_save"] == ["FileExistsError", "PeerFailure"]


def test_exact_evaluation_over_uneven_shards_and_gather_for_metrics(check):
    assert check["eval"]["count"] == 101
    assert check["eval"]["accuracy"] == pytest.approx(check["ref_eval"]["accuracy"], abs=1e-9)
    assert check["eval"]["loss"] == pytest.approx(check["ref_eval"]["loss"], rel=1e-6)
    assert sorted(check["gathered"]) == list(range(9))


def parity(*args, check_code=0):
    proc = run(TOOLKIT + ["parity", *args], check=False, timeout=240)
    assert proc.returncode == check_code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


# Against ddp, a model with a scalar parameter and a weight tied across blocks (kept whole, not sharded).
@pytest.mark.parametrize("other, args_other, target", [("ddp", "--batch-size 4", "parity_scalar_target.py"),
                                                       ("single", "--batch-size 8", "parity_target.py")])
def test_parity_fsdp_agrees_with_ddp_and_one_process(other, args_other, target):
    out = parity(CPU, CPU, "--engine-a", "fsdp", "--engine-b", other, "--steps", "3", "--args-a=--batch-size 4",
                 f"--args-b={args_other}", "--", SCRIPTS / target)
    assert "engine fsdp, 2 process(es)" in out and "verdict: AGREE" in out


NOTICE = "[toolkit] accelerate runs FSDP only on GPUs"


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate runs its own FSDP where CUDA is visible")
def test_fsdp_profile_without_cuda_shards_with_the_fsdp_engine_and_says_so_once(tmp_path):
    """Accelerate itself would prepare a DistributedDataParallel model here (state MULTI_CPU) without a word."""
    out = tmp_path / "probe.json"
    proc = run(ACCELERATE + ["--config_file", CONFIGS / "fsdp.yaml", SCRIPTS / "probe.py", "--out", out])
    result = read_json(out)
    assert (result["engine"], result["world"], result["rank_sum"]) == ("fsdp", 2, 1)
    assert sorted(result["gathered"]) == list(range(9))
    assert (proc.stdout + proc.stderr).count(NOTICE) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate runs its own FSDP where CUDA is visible")
def test_toolkit_env_says_what_an_fsdp_profile_runs():
    from toolkit.check.env import collect

    report = collect(str(CONFIGS / "fsdp.yaml"), environ={})
    assert report["toolkit_launch"]["runs"] == "fsdp"
    assert [f["code"] for f in report["findings"] if f["code"].startswith("fsdp")] == ["fsdp-without-cuda"]
    replicated = collect(str(CONFIGS / "fsdp.yaml"), environ={"TOOLKIT_ENGINE": "ddp"})
    assert [f["code"] for f in replicated["findings"] if f["code"].startswith("fsdp")] == ["fsdp-profile-replicated"]
    assert collect(str(CONFIGS / "fsdp.yaml"), environ={"TOOLKIT_ENGINE": "fsdp"})["toolkit_launch"]["runs"] == "fsdp"


# The recipe at global batch 256 (128 per process at world 2), 12 steps of epoch 0 (19 steps long),
# a full checkpoint every 4: steps 4 and 8 are mid-epoch resume points.
RECIPE = [CIFAR, "--dataset", "synthetic", "--model", "tiny", "--epochs", 1, "--max-steps", 12,
          "--global-batch-size", 256, "--checkpoint-every", 4, "--keep", 100]
# Resumed runs follow the fsdp run's trajectory: measured 0 (ddp, accelerate: the same arithmetic) and <= 1e-7
# (one process at batch 256: the rounding of one mean against two) on every loss; a wrong resume (position,
# momentum, weights) moves the first losses by 1e-2 or more (tests/test_recipe.py measured 6e-2).
RESUME_ATOL = 1e-5


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}


def recipe(launcher, out, *args):
    return run(launcher + [*RECIPE, "--output-dir", out, "--data-dir", out.parent / "data", *args], timeout=300)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "fsdp"
    recipe(TORCHRUN + ["--master_port", free_port()], out, "--engine", "fsdp")
    return out


def check_resumed(out, reference, at, engine, world):
    summary = read_json(out / "summary.json")
    assert (summary["engine"], summary["world_size"], summary["steps"]) == (engine, world, 12)
    got, ref = losses(out), losses(reference)
    assert sorted(got) == list(range(at + 1, 13))  # resumed mid-epoch: nothing replayed, nothing skipped
    worst = max(abs(got[s] - ref[s]) for s in got)
    assert worst <= RESUME_ATOL, f"{engine} resumed at {at}: losses differ from the fsdp run's by {worst:.2e}"
    diff = max_weight_diff(final_weights(reference, 12), final_weights(out, 12))
    assert diff <= 1e-4, diff
    assert abs(summary["test_accuracy"] - read_json(reference / "summary.json")["test_accuracy"]) <= 0.002
    return worst, diff


def test_fsdp_checkpoint_resumes_under_ddp_single_and_accelerate_and_back(tmp_path, fsdp_run):
    """fsdp@4 -> ddp, one process (single) and accelerate; single@8 -> fsdp (world 1 -> 2): every resumed run
    ends where the fsdp run did, and the fsdp run ends where ddp and accelerate do."""
    at4 = fsdp_run / "checkpoints" / "step-00000004"
    assert json.loads((at4 / "state.json").read_text())["engine"] == "fsdp"
    recipe(TORCHRUN + ["--master_port", free_port()], tmp_path / "ddp", "--engine", "ddp", "--resume", at4)
    recipe([PY], tmp_path / "single", "--engine", "single", "--resume", at4)
    recipe(ACCELERATE + ["--config_file", CPU], tmp_path / "accelerate", "--resume", at4)
    at8 = tmp_path / "single" / "checkpoints" / "step-00000008"
    recipe(TORCHRUN + ["--master_port", free_port()], tmp_path / "back", "--engine", "fsdp", "--resume", at8)
    for name, engine, world, at in [("ddp", "ddp", 2, 4), ("single", "single", 1, 4), ("accelerate", "accelerate", 2, 4),
                                    ("back", "fsdp", 2, 8)]:
        worst, diff = check_resumed(tmp_path / name, fsdp_run, at, engine, world)
        print(f"{engine}@{at}: max |loss diff| {worst:.1e}, max |weight diff| {diff:.1e}")


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """The fsdp run again with sharded checkpoints (2 ranks), and one process (world 1) resumed from its step 4."""
    base = tmp_path_factory.mktemp("sharded")
    sharded = ["--engine", "fsdp", "--checkpoint-format", "sharded"]
    recipe(TORCHRUN + ["--master_port", free_port()], base / "two", *sharded)
    recipe([PY], base / "one", *sharded, "--resume", base / "two" / "checkpoints" / "step-00000004")
    return base


def consolidated(run_dir, out):
    from toolkit import cli

    assert cli.main(["checkpoint", "consolidate", str(run_dir / "checkpoints"), "--out", str(out)]) == 0
    return out


def test_sharded_checkpoints_hold_each_ranks_shards_and_nothing_gathered(sharded_runs, fsdp_run):
    from toolkit.checkpoint.functional import verify_checkpoint
    from toolkit.checkpoint.functional_sharded import read_index

    at4 = sharded_runs / "two" / "checkpoints" / "step-00000004"
    verify_checkpoint(at4)  # the manifest covers every shard
    manifest = read_json(at4 / "manifest.json")
    assert (manifest["checkpoint_format"], manifest["world_size"], manifest["step"]) == ("sharded", 2, 4)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= manifest["files"].keys()
    assert not {"model.safetensors", "optimizer.bin"} & manifest["files"].keys()
    index = read_index(at4).state_dict_metadata  # each parameter and its momentum in two pieces, one per rank
    assert {len(index["model.0.weight"].chunks), len(index["optim.state.0.weight.momentum_buffer"].chunks)} == {2}
    assert not [p for p in at4.parent.iterdir() if p.name.startswith(".")]  # no temp folder left behind
    assert losses(sharded_runs / "two") == losses(fsdp_run)  # saving sharded changes nothing in training


def test_sharded_checkpoint_resumes_at_another_world_size_and_consolidates_to_the_full_runs_weights(
        sharded_runs, fsdp_run, tmp_path):
    """2 ranks save sharded; 1 process resumes from step 4 and ends where the uninterrupted run did. Consolidated,
    both runs' last checkpoints equal the full-format run's weights and optimizer state."""
    one = sharded_runs / "one"
    assert read_json(one / "checkpoints" / "step-00000012" / "manifest.json")["world_size"] == 1
    got, ref = losses(one), losses(fsdp_run)
    assert sorted(got) == list(range(5, 13))  # resumed mid-epoch: nothing replayed, nothing skipped
    # Measured: 2.4e-7 on losses, 6e-8 on weights, 2.8e-7 on momentum (one mean of 256 against two of 128);
    # dropping the optimizer shards on resume moved the losses by 1.7e-2.
    assert max(abs(got[s] - ref[s]) for s in got) <= TIGHT
    full = fsdp_run / "checkpoints" / "step-00000012"
    reference, reference_optimizer = final_weights(fsdp_run, 12), torch.load(full / "optimizer.bin", weights_only=True)
    for name, tolerance in [("two", 0.0), ("one", TIGHT)]:
        step12 = consolidated(sharded_runs / name, tmp_path / name) / "step-00000012"
        assert max_weight_diff(reference, safetensors.torch.load_file(step12 / "model.safetensors")) <= tolerance, name
        optimizer = torch.load(step12 / "optimizer.bin", weights_only=True)
        assert optimizer["param_groups"] == reference_optimizer["param_groups"]
        assert max((optimizer["state"][k]["momentum_buffer"] - v["momentum_buffer"]).abs().max().item()
                   for k, v in reference_optimizer["state"].items()) <= tolerance, name
        assert read_json(step12 / "manifest.json")["checkpoint_format"] == "full"
    weights_only = consolidated(sharded_runs / "two", tmp_path / "w.safetensors")
    assert max_weight_diff(reference, safetensors.torch.load_file(weights_only)) == 0.0


ONE_PROCESS = """
import torch, toolkit
from accelerate.test_utils.scripts.test_sync import test_noop_sync
accelerator = toolkit.build_accelerator("fsdp", mixed_precision="bf16")
torch.manual_seed(0)
net = torch.nn.Linear(8, 3)
w, b = net.weight.detach().clone(), net.bias.detach().clone()
seen = []
net.register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, a[0].dtype)))
net = accelerator.prepare(net)
x = torch.randn(4, 8)
out = net(x)
expected = torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), b.bfloat16()).float()
print("BF16", out.dtype, seen[0], accelerator.get_state_dict(net)["weight"].dtype, torch.equal(out, expected))
test_noop_sync(toolkit.build_accelerator("fsdp"))  # raises unless every gradient equals the full-batch model's
print("NOOP passed")
accelerator.end_training()
"""


@pytest.fixture(scope="module")
def one_process():
    """What one process started without a launcher printed; the two checks below share it."""
    return run([PY, "-c", ONE_PROCESS]).stdout.strip().splitlines()


def test_bf16_goes_through_the_mixed_precision_policy(one_process):
    """bf16 weights and inputs inside the forward, fp32 shards kept and fp32 outputs handed back: the output equals
    a hand-written bf16 linear layer exactly."""
    line = next(line for line in one_process if line.startswith("BF16"))
    assert line == "BF16 torch.float32 (torch.bfloat16, torch.bfloat16) torch.float32 True", line


def test_accelerates_noop_sync_test_passes_at_one_process(one_process):
    """Accelerate's test_noop_sync on RegressionModel (two scalar parameters, nothing fully_shard can shard): with
    one process, no_sync changes no gradient. Its 2-rank siblings run in tests/test_fsdp_scalars.py."""
    assert one_process[-1] == "NOOP passed"
