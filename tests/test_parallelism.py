"""Accelerate's ParallelismConfig under the fsdp engine (toolkit/engines/parallelism.py): a profile's
parallelism_config keys under `toolkit launch`, `build_accelerator(parallelism_config=...)` and the toolkit's own
`toolkit.ParallelismConfig`. dp_replicate 2 x dp_shard 2 (HSDP) on 4 processes runs the fsdp engine's own check
(tests/scripts/fsdp_check.py) against its plain one-process reference; a mesh that does not tile the world, or
a dimension the engine does not run, is refused in one sentence before anything trains.
"""

import json
import textwrap

import pytest
from conftest import CONFIGS, PY, ROOT, SCRIPTS, TOOLKIT, cpu_fsdp_profile, read_json, run

from toolkit.launch.launcher import free_port

# fp32, the check's reference with the same global batch in one process: measured 1.5e-8 on weights at world 4
# (HSDP); a replica that did not average its gradients with the other moves them by 1e-2 or more.
TIGHT = 1e-6
MESH = """\
    fsdp_config:
      fsdp_version: 2
      fsdp_state_dict_type: FULL_STATE_DICT
    parallelism_config:
      parallelism_config_dp_replicate_size: 2
      parallelism_config_dp_shard_size: 2
"""


def profile(tmp_path, processes):
    path = tmp_path / f"hsdp_{processes}.yaml"
    path.write_text(cpu_fsdp_profile(processes, MESH))
    return path


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    run(TOOLKIT + ["launch", "--config_file", profile(root, 4), "--engine", "fsdp", SCRIPTS / "fsdp_check.py",
                   "--out", root / "check.json"], timeout=300)
    return read_json(root / "check.json")


def test_the_profiles_mesh_is_the_engines_device_mesh(hsdp):
    assert (hsdp["world"], hsdp["mesh"]) == (4, [[2, 2], ["dp_replicate", "dp_shard"]])
    # Each rank holds half the model (its shard group has 2 ranks), not a quarter: output sizes 7 and 3 pad.
    assert hsdp["full_numel"] / 2 <= hsdp["local_numel"] <= hsdp["full_numel"] / 2 + 16


def test_hsdp_trains_evaluates_and_saves_as_a_plain_loop(hsdp):
    assert max(hsdp["weight_diffs"]) <= TIGHT, hsdp["weight_diffs"]
    assert max(abs(a - b) for a, b in zip(hsdp["norms"], hsdp["ref_norms"])) <= TIGHT  # the whole gradient's norm
    assert hsdp["resumed_diff"] <= TIGHT and hsdp["no_sync_diff"] <= TIGHT
    assert hsdp["eval"]["count"] == 101 and sorted(hsdp["gathered"]) == list(range(9))


def test_a_mesh_that_does_not_tile_the_world_is_refused_in_one_sentence_under_toolkit_launch(tmp_path):
    proc = run(TOOLKIT + ["launch", "--config_file", profile(tmp_path, 2), "--engine", "fsdp", SCRIPTS / "probe.py",
                          "--out", tmp_path / "probe.json"], check=False, timeout=120)
    sentence = ("error: the ParallelismConfig's mesh (pp 1 x dp_replicate 2 x dp_shard 2 x tp 1 = 4 processes) cannot tile this "
                "world of 2; make the sizes multiply to 2.")
    assert proc.returncode == 2 and (proc.stdout + proc.stderr).strip().splitlines()[-1] == sentence, proc.stderr
    assert (proc.stdout + proc.stderr).count("cannot tile") == 1


def test_toolkit_launch_takes_accelerate_launchs_mesh_flags_and_checks_them_before_starting(tmp_path):
    cpu = CONFIGS / "cpu.yaml"
    flags = ["--parallelism-config-dp-replicate-size", "2", "--parallelism-config-dp-shard-size", "2"]
    plan = run(TOOLKIT + ["launch", "--config_file", cpu, "--engine", "fsdp", "--num_processes", "4", *flags,
                          "--dry-run", SCRIPTS / "probe.py"]).stdout
    assert "ACCELERATE_USE_PARALLELISM_CONFIG=true" in plan and "PARALLELISM_CONFIG_DP_REPLICATE_SIZE=2" in plan
    proc = run(TOOLKIT + ["launch", "--config_file", cpu, "--engine", "fsdp", *flags, SCRIPTS / "probe.py", "--out",
                          tmp_path / "never.json"], check=False)
    assert proc.returncode == 2 and not (tmp_path / "never.json").exists()
    assert proc.stderr.strip().splitlines() == ["error: the ParallelismConfig's mesh (pp 1 x dp_replicate 2 x dp_shard 2 x tp 1 "
                                                "= 4 processes) cannot tile this world of 2; make the sizes multiply to 2."]


def test_a_scripts_parallelism_config_under_torchrun_is_refused_before_training_when_it_cannot_tile(tmp_path):
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""\
        import toolkit
        toolkit.build_accelerator(parallelism_config=toolkit.ParallelismConfig(dp_shard_size=4))
        print("TRAINED")
        """))
    proc = run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(), script],
               check=False, timeout=120)
    assert proc.returncode != 0 and "TRAINED" not in proc.stdout
    assert "mesh (pp 1 x dp_replicate 1 x dp_shard 4 x tp 1 = 4 processes) cannot tile this world of 2" in proc.stdout + proc.stderr


def test_what_the_engine_does_not_run_is_refused_in_one_sentence():
    from toolkit import ParallelismConfig, UserError
    from toolkit.launch.parallelism import mesh_shape, read_parallelism_config

    assert mesh_shape(ParallelismConfig(dp_shard_size=4), 4, "fsdp") == ((4,), ("dp_shard",))
    assert mesh_shape(ParallelismConfig(dp_shard_size=2, tp_size=2), 4, "fsdp") == ((2, 2), ("dp_shard", "tp"))
    with pytest.raises(UserError, match=r"\(dp_replicate_size, dp_shard_size, tp_size, pp_size\), not cp_size 2; "
                                        r"context parallel runs under the accelerate engine on GPUs"):
        mesh_shape(ParallelismConfig(cp_size=2, pp_size=2), 4, "fsdp")
    with pytest.raises(UserError, match="dp_replicate_size alone replicates the whole model, which is DDP"):
        mesh_shape(ParallelismConfig(dp_replicate_size=2), 2, "fsdp")
    with pytest.raises(UserError, match="ParallelismConfig's tp_size must be a whole number of at least 1, not 0"):
        ParallelismConfig(tp_size=0)

    class AcceleratesOwn:  # Accelerate's ParallelismConfig, read by its field names (it has no pp_size)
        dp_replicate_size, dp_shard_size, tp_size, cp_size, sp_size = 2, 2, 1, 1, 1

    assert read_parallelism_config(AcceleratesOwn()).total_size == 4


def test_toolkit_env_shows_the_profiles_mesh_and_refuses_one_that_cannot_tile(tmp_path):
    from toolkit.check.env import collect

    report = collect(str(profile(tmp_path, 4)), environ={})
    assert report["toolkit_launch"]["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1, "cp": 1, "pp": 1}
    assert not [f for f in report["findings"] if f["code"] == "mesh-refused"]
    refused = collect(str(profile(tmp_path, 2)), environ={})
    assert [f["message"] for f in refused["findings"] if f["code"] == "mesh-refused"] == [
        "the ParallelismConfig's mesh (pp 1 x dp_replicate 2 x dp_shard 2 x tp 1 = 4 processes) cannot tile this world of 2; make "
        "the sizes multiply to 2."]


def test_the_accelerate_engine_hands_a_real_accelerator_accelerates_own_config():
    from accelerate.parallelism_config import ParallelismConfig as AcceleratesConfig

    from toolkit import ParallelismConfig, UserError
    from toolkit.launch.parallelism import to_accelerate

    given = to_accelerate(ParallelismConfig(dp_replicate_size=2, dp_shard_size=4))
    assert isinstance(given, AcceleratesConfig)
    assert (given.dp_replicate_size, given.dp_shard_size, given.tp_size, given.cp_size) == (2, 4, 1, 1)
    with pytest.raises(UserError, match="Accelerate has no pipeline parallel: the accelerate engine cannot run pp_size 2"):
        to_accelerate(ParallelismConfig(pp_size=2))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="accelerate builds its own mesh where CUDA is visible")
def test_a_mesh_given_to_the_accelerate_engine_without_cuda_runs_the_fsdp_engine(tmp_path):
    """Accelerate 1.16 refuses a ParallelismConfig on a CPU state (MULTI_CPU); the fsdp engine runs its dp mesh."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""\
        import toolkit
        a = toolkit.build_accelerator("accelerate", parallelism_config=toolkit.ParallelismConfig(dp_shard_size=2))
        a.print("RAN", a.name, list(a.torch_device_mesh.mesh_dim_names))
        """))
    proc = run([PY, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(), script])
    assert "RAN fsdp ['dp_shard']" in proc.stdout and proc.stdout.count("[toolkit] accelerate runs FSDP only") == 1


# The LM recipe's losses, HSDP 2 x 2 against one process at the same global batch, 8 fp32 steps: measured 1.2e-6
# (avx2) and 9.5e-7 (ATEN_CPU_CAPABILITY=default); the bound for a mesh is 1e-5. A replica that skipped the
# average, or a resume from the wrong step, moves them by 1e-2 or more.
LM_MESH = 1e-5


def lm_losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}


def test_the_lm_recipe_trains_under_hsdp_as_one_process_and_its_sharded_checkpoint_resumes_in_one(tmp_path):
    lm = [ROOT / "recipes" / "lm.py", "--max-steps", 8]
    sharded = tmp_path / "hsdp_sharded.yaml"
    sharded.write_text(cpu_fsdp_profile(4, MESH).replace("FULL_STATE_DICT", "SHARDED_STATE_DICT"))
    run(TOOLKIT + ["launch", "--config_file", sharded, "--engine", "fsdp", *lm, "--checkpoint-every", 4,
                   "--checkpoint-format", "sharded", "--output-dir", tmp_path / "hsdp"], timeout=300)
    run([PY, *lm, "--output-dir", tmp_path / "one"])
    at4 = tmp_path / "hsdp" / "checkpoints" / "step-00000004"
    assert read_json(at4 / "manifest.json")["checkpoint_format"] == "sharded"
    run([PY, *lm, "--resume", at4, "--output-dir", tmp_path / "resumed"])
    hsdp, one, resumed = (lm_losses(tmp_path / name) for name in ("hsdp", "one", "resumed"))
    assert sorted(hsdp) == sorted(one) == list(range(1, 9)) and sorted(resumed) == list(range(5, 9))
    assert max(abs(hsdp[s] - one[s]) for s in one) <= LM_MESH
    assert max(abs(resumed[s] - one[s]) for s in resumed) <= LM_MESH
