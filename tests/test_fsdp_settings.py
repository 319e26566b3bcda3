"""The fsdp engine takes FSDP settings in Accelerate's own forms (toolkit/engines/fsdp_settings.py): an FSDP
profile's fsdp_config under `toolkit launch`, and `Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(...))`.
Each honoured field is seen to act on the prepared model (its units, where its parameters are between forward and
backward, its compute dtype, its recomputation, its saved format), and every case trains as a plain one-process
loop does. One 2-rank launch runs every case (tests/scripts/fsdp_settings_check.py).
"""

import math
import textwrap

import pytest
import torch
from conftest import PY, SCRIPTS, TOOLKIT, TORCHRUN, cpu_fsdp_profile, read_json, run

from toolkit.launch.launcher import free_port

# fp32: the weights after 2 SGD steps of 2 x 3 samples against one process's 6, measured 3.0e-8 on both kernel
# paths (avx2 and ATEN_CPU_CAPABILITY=default); a rank that kept its own initial weights, or a gradient not
# averaged, moves them by 1e-2 or more.
TIGHT = 1e-6
# bf16 compute (FSDP2's MixedPrecisionPolicy) against the fp32 reference: measured 9.6e-4; bf16's unit roundoff
# is 3.9e-3 on weights of order 1.
BF16 = 1e-2
PROFILE = cpu_fsdp_profile(2, """\
    fsdp_config:
      fsdp_version: 2
      fsdp_auto_wrap_policy: SIZE_BASED_WRAP
      fsdp_min_num_params: 300
      fsdp_reshard_after_forward: false
      fsdp_state_dict_type: FULL_STATE_DICT
""")
FULL_FILES = ["manifest.json", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl",
              "state.json"]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_settings")
    profile = root / "fsdp_cpu.yaml"
    profile.write_text(PROFILE)
    # Inductor's own cache in a folder of this run: torch keys its kernels without ATEN_CPU_CAPABILITY, so a kernel
    # cached by a run on the other kernel path fails to compile (seen: "'at::vec' has not been declared").
    run(TOOLKIT + ["launch", "--config_file", profile, "--engine", "fsdp", SCRIPTS / "fsdp_settings_check.py",
                   "--out", root / "out.json"], timeout=240, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"))
    return read_json(root / "out.json")


def cases(check, *names):
    return [check["cases"][name] for name in names]


def test_every_setting_trains_as_a_plain_loop(check):
    exact = {name: case["max_diff"] for name, case in check["cases"].items() if name != "mixed_precision"}
    assert max(exact.values()) <= TIGHT, exact
    assert check["cases"]["mixed_precision"]["max_diff"] <= BF16


def test_the_profiles_fsdp_config_reaches_the_engine_through_toolkit_launch(check):
    profile, default = cases(check, "profile", "default")
    # SIZE_BASED_WRAP above 300 parameters: the 3 blocks (544 each) and the root; the ModuleList holding them has
    # no forward and cannot be a unit. Without settings the engine shards each block of shard_units: 5 and the root.
    assert (profile["units"], default["units"]) == (4, 6)
    assert profile["sharded_after_forward"] == [False, False]  # fsdp_reshard_after_forward: false
    assert default["sharded_after_forward"] == [True, True]
    assert profile["saved"] == FULL_FILES


def test_auto_wrap_policy_decides_the_units(check):
    no_wrap, blocks, named, size = cases(check, "no_wrap", "transformer", "named", "size")
    assert no_wrap["units"] == 1  # the root only, as Accelerate's NO_WRAP
    assert blocks["units"] == 4  # the model's _no_split_modules: 3 Blocks, and the root
    assert named["units"] == 9  # every Linear: 1 + 3 x 2 + 1, and the root
    assert size["units"] == 4


def test_reshard_after_forward_false_keeps_the_gathered_weights_for_backward(check):
    resharded, kept, fsdp1 = cases(check, "transformer", "reshard_false", "fsdp1_shard_grad_op")
    assert resharded["sharded_after_forward"] == [True, True]
    assert kept["sharded_after_forward"] == [False, False]
    # An FSDP1 plugin is read as `accelerate to-fsdp2` converts it: SHARD_GRAD_OP is reshard_after_forward=False.
    assert fsdp1["sharded_after_forward"] == [False, False]


def test_activation_checkpointing_recomputes_the_wrapped_blocks_in_backward(check):
    plain, checkpointed = cases(check, "transformer", "activation_checkpointing")
    assert (plain["checkpointed"], checkpointed["checkpointed"]) == (0, 3)
    assert (plain["lin1_calls_per_step"], checkpointed["lin1_calls_per_step"]) == (1.0, 2.0)


def test_mixed_precision_policy_computes_in_its_dtype_over_fp32_weights(check):
    mixed, = cases(check, "mixed_precision")
    assert (mixed["compute_dtypes"], mixed["param_dtype"]) == (["bfloat16"], "float32")
    assert cases(check, "transformer")[0]["compute_dtypes"] == ["float32"]


def test_cpu_offload_puts_the_shards_in_cpu_memory(check):
    # On a CPU machine both live in CPU memory: what shows is FSDP's own offload flag on the sharded parameter
    # (the GPU check of where parameters live between steps is tests/test_gpu.py's).
    offloaded, plain = cases(check, "cpu_offload", "transformer")
    assert (offloaded["offloaded"], plain["offloaded"]) == (True, False)


def test_state_dict_type_decides_what_save_state_writes(check):
    full, sharded = cases(check, "fsdp1_shard_grad_op", "sharded")
    assert (full["checkpoint_format"], full["saved"]) == ("full", FULL_FILES)
    assert sharded["checkpoint_format"] == "sharded"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(sharded["saved"]) and "model.safetensors" not in sharded["saved"]


def test_a_full_state_dict_config_without_rank0_only_hands_every_rank_the_weights(check):
    # Accelerate's fsdp_with_peak_mem_tracking.py builds exactly this plugin; its training runs.
    example, default = cases(check, "example", "transformer")
    assert (example["state_keys_per_rank"], default["state_keys_per_rank"]) == ([16, 16], [16, 0])


def test_cpu_ram_efficient_loading_fills_a_meta_model_with_rank_0s_weights(check):
    # Rank 1 built its model on the meta device; without the setting, prepare could not even copy it.
    efficient, = cases(check, "cpu_ram_efficient_loading")
    assert efficient["max_diff"] <= TIGHT


def test_what_fsdp2_cannot_run_is_refused_in_one_sentence_naming_it(check):
    refusals = check["refusals"]
    assert "no backward_prefetch (an FSDP1 setting" in refusals["backward_prefetch"]
    assert "sharding_strategy NO_SHARD; use the ddp engine" in refusals["no_shard"]
    assert "transformer_cls_names_to_wrap names Nope, which the model does not have" in refusals["unknown_class"]
    assert "activation_checkpointing checkpoints the modules the auto_wrap_policy picks" in refusals["ac_without_wrap"]
    assert "checkpoint_format 'full' contradicts the FSDP plugin's state_dict_type SHARDED_STATE_DICT" in \
        refusals["contradicting_format"]
    assert all("\n" not in line for line in refusals.values())


def test_toolkit_launch_hands_the_fsdp_engine_the_variables_accelerate_launch_would(tmp_path):
    from toolkit.launch.launcher import plan_launch
    from toolkit.launch.profiles import load_profile

    path = tmp_path / "p.yaml"
    path.write_text(PROFILE)
    profile = load_profile(str(path))
    env = plan_launch(profile, "fsdp", ["train.py"], gpus=0).env
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"], env["FSDP_AUTO_WRAP_POLICY"], env["FSDP_MIN_NUM_PARAMS"],
            env["FSDP_RESHARD_AFTER_FORWARD"]) == ("true", "2", "SIZE_BASED_WRAP", "300", "false")
    assert not any(k.startswith("FSDP_") for k in plan_launch(profile, "ddp", ["train.py"], gpus=0).env)


def test_an_engine_without_sharding_points_an_fsdp_plugin_to_the_fsdp_engine():
    from accelerate import FullyShardedDataParallelPlugin

    from toolkit import build_accelerator
    from toolkit.errors import UserError

    with pytest.raises(UserError, match=r"cannot honour Accelerator\(fsdp_plugin=...\); use the fsdp engine"):
        build_accelerator("single", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))


def test_ignored_modules_stay_whole_on_every_rank_and_train_as_the_rest(check):
    ignored, plain = cases(check, "ignored_modules", "transformer")
    assert (ignored["head_sharded"], plain["head_sharded"]) == (False, True)
    assert ignored["max_diff"] <= TIGHT  # averaged over the ranks, as DDP does, where FSDP2 alone would not


def test_dynamo_backend_compiles_the_sharded_model(check):
    # Accelerate's Accelerator(dynamo_backend=...) under FSDP2; FSDP's own hooks stay outside the graphs.
    compiled, plain = cases(check, "compiled", "transformer")
    assert (compiled["prepared"], compiled["compiled_graphs"] > 0) == ("OptimizedModule", True)
    assert (plain["prepared"], plain["compiled_graphs"]) == ("FSDPNet", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="accelerate runs its own FSDP where CUDA is visible")
def test_an_fsdp_plugin_given_to_the_accelerate_engine_without_cuda_shards_with_the_fsdp_engine():
    """Accelerate 1.16 on CPU would take the plugin and train DistributedDataParallel without a word."""
    code = ("import toolkit, torch; from accelerate import FullyShardedDataParallelPlugin as P; "
            "a = toolkit.build_accelerator('accelerate', fsdp_plugin=P(fsdp_version=2, reshard_after_forward=False)); "
            "m = a.prepare(torch.nn.Linear(4, 4)); print(a.name, type(m).__name__, a.fsdp_settings.reshard_after_forward)")
    proc = run([PY, "-c", code])
    assert proc.stdout.strip().splitlines()[-1] == "fsdp FSDPLinear False"
    assert proc.stdout.count("[toolkit] accelerate runs FSDP only on GPUs") == 1


def test_bf16_runs_batchnorm_in_fp32_inside_blocks_and_outside_them(check):
    # FSDP2 cast BatchNorm's weights to bf16 beside its fp32 statistics, which CPU's kernel refuses; and under a
    # wrap policy the root's own layers received the blocks' fp32 outputs (resnet9 and resnet18 under fsdp.yaml
    # stopped at their first step). Now BatchNorm computes in fp32, as FSDP1 left it, and hands on bf16.
    for name, case in check["bf16"].items():
        assert (case["conv_inputs"], case["bn_weight"], case["output"]) == (["bfloat16"], "float32", "float32"), name
        assert all(math.isfinite(loss) for loss in case["losses"]), name


def test_a_script_that_gives_an_fsdp_plugin_under_torchrun_shards_as_accelerate_would(tmp_path):
    """torchrun alone picks ddp; a script's plugin asks for sharding, as Accelerator(fsdp_plugin=...) does."""
    script = tmp_path / "user.py"
    script.write_text(textwrap.dedent("""\
        import torch, toolkit
        from accelerate import FullyShardedDataParallelPlugin
        accelerator = toolkit.build_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = accelerator.prepare(torch.nn.Linear(4, 4))
        accelerator.print("RAN", accelerator.name, accelerator.num_processes, type(model).__name__)
        """))
    proc = run(TORCHRUN + ["--master_port", free_port(), script])
    assert "RAN fsdp 2 FSDPLinear" in proc.stdout
