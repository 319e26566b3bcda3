"""Compilation as Accelerate does it in `prepare()` (toolkit/engines/compiling.py): a profile's dynamo_config under
`toolkit launch`, `Accelerator(dynamo_backend=...)` and `Accelerator(dynamo_plugin=TorchDynamoPlugin(...))`.

The recipe on 2 ddp ranks, compiled by the profile and not, trains the same, and the compiled run's checkpoint
(saved without `_orig_mod.`) resumes an uncompiled run where the compiled one went. Inductor's cache is pointed at
a folder of the test's own, so that the compiled run is seen to have compiled.
"""

import json
import textwrap

import pytest
import safetensors.torch
import torch
from conftest import CONFIGS, ROOT, TOOLKIT, run

# The first step's loss, compiled against eager: measured 0.0 here on both kernel paths (avx2 and
# ATEN_CPU_CAPABILITY=default); the two kernel paths themselves differ by 4.8e-7 at step 1. Over 20 steps the
# kernel paths drift apart by 9.1e-6 (compiled against eager: 0.0 on each); 5e-5 leaves room for inductor's own
# kernels on another CPU to round like another path. A compiled model that skipped the ranks' averaging, or a
# resume that lost its place, moves the losses by 1e-2 or more.
FIRST_STEP = 1e-6
TWENTY_STEPS = 5e-5
RECIPE = [ROOT / "recipes" / "cifar.py", "--dataset", "synthetic", "--model", "tiny", "--epochs", 1,
          "--max-steps", 20, "--global-batch-size", 64, "--checkpoint-every", 10, "--keep", 100]


def losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "step"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    profile = root / "cpu_inductor.yaml"
    profile.write_text((CONFIGS / "cpu.yaml").read_text() + "dynamo_config:\n  dynamo_backend: INDUCTOR\n")
    data = ["--data-dir", root / "data"]
    caches = {name: root / f"inductor-{name}" for name in ("compiled", "plain", "resumed")}

    def launch(name, config, *extra):
        run(TOOLKIT + ["launch", "--config_file", config, "--engine", "ddp", *RECIPE, *data, "--output-dir",
                       root / name, *extra], timeout=300, TORCHINDUCTOR_CACHE_DIR=str(caches[name]))

    launch("compiled", profile)
    launch("plain", CONFIGS / "cpu.yaml")
    launch("resumed", CONFIGS / "cpu.yaml", "--resume", root / "compiled" / "checkpoints" / "step-00000010")
    return root, caches


def test_the_profiles_dynamo_config_compiles_the_model_in_prepare(runs):
    _, caches = runs
    compiled = [p for p in caches["compiled"].rglob("*") if p.is_file()]
    assert compiled, "inductor wrote nothing: the model was not compiled"
    assert not caches["plain"].exists() or not any(p.is_file() for p in caches["plain"].rglob("*"))


def test_compiled_and_uncompiled_runs_train_the_same(runs):
    root, _ = runs
    compiled, plain = losses(root / "compiled"), losses(root / "plain")
    assert sorted(compiled) == sorted(plain) == list(range(1, 21))
    assert abs(compiled[1] - plain[1]) <= FIRST_STEP
    assert max(abs(compiled[s] - plain[s]) for s in compiled) <= TWENTY_STEPS


def test_the_compiled_runs_checkpoint_resumes_an_uncompiled_run(runs):
    root, _ = runs
    saved = safetensors.torch.load_file(root / "compiled" / "checkpoints" / "step-00000010" / "model.safetensors")
    assert not [k for k in saved if "_orig_mod" in k] and "0.weight" in saved
    resumed, compiled = losses(root / "resumed"), losses(root / "compiled")
    assert sorted(resumed) == list(range(11, 21))
    assert max(abs(resumed[s] - compiled[s]) for s in resumed) <= TWENTY_STEPS


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(2))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_dynamo_backend_compiles_the_prepared_model_and_unwrap_model_says_which_it_returns():
    from toolkit import build_accelerator

    accelerator = build_accelerator("single", dynamo_backend="eager")  # dynamo's tracing, no code generation
    model = Blocks()
    prepared = accelerator.prepare(model)
    assert type(prepared).__name__ == "OptimizedModule" and prepared._orig_mod is model
    assert accelerator.unwrap_model(prepared) is prepared  # Accelerate's default: keep_torch_compile=True
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
    assert list(accelerator.get_state_dict(prepared)) == list(model.state_dict())  # no `_orig_mod.`
    x = torch.randn(3, 4)
    torch.testing.assert_close(prepared(x), model(x), rtol=0, atol=0)


def test_a_compiled_models_save_state_loads_into_an_uncompiled_one(tmp_path):
    from toolkit import build_accelerator

    torch.manual_seed(0)
    compiled = build_accelerator("single", dynamo_backend="eager")
    model = compiled.prepare(Blocks())
    saved = compiled.save_state(str(tmp_path / "ckpt"))
    keys = sorted(safetensors.torch.load_file(f"{saved}/model.safetensors"))
    assert keys == sorted(Blocks().state_dict()), keys  # no `_orig_mod.` anywhere
    plain = build_accelerator("single")
    fresh = plain.prepare(Blocks())
    plain.load_state(saved)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model._orig_mod.state_dict().values()))


def test_regional_compilation_compiles_each_repeated_block_in_place():
    from accelerate.utils import TorchDynamoPlugin

    from toolkit import build_accelerator

    plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    model = Blocks()
    keys = list(model.state_dict())
    prepared = build_accelerator("single", dynamo_plugin=plugin).prepare(model)
    assert prepared is model and list(prepared.state_dict()) == keys
    assert [block._compiled_call_impl is not None for block in model.blocks] == [True, True]
    assert model.head._compiled_call_impl is not None  # the rest, region by region (Accelerate's rule)
    assert model._compiled_call_impl is None  # the model itself is not compiled whole


def test_compile_settings_accelerate_refuses_are_refused_in_one_sentence():
    from accelerate.utils import TorchDynamoPlugin

    from toolkit import build_accelerator
    from toolkit.errors import UserError

    with pytest.raises(UserError, match="give dynamo_plugin or dynamo_backend, not both"):
        build_accelerator("single", dynamo_backend="inductor", dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    with pytest.raises(UserError, match="dynamo_backend 'nonsense' is not one of Accelerate's backends"):
        build_accelerator("single", dynamo_backend="nonsense")


def test_toolkit_launch_hands_the_profiles_dynamo_config_to_every_engine(tmp_path):
    from toolkit.launch.launcher import plan_launch
    from toolkit.launch.profiles import load_profile

    path = tmp_path / "p.yaml"
    path.write_text((CONFIGS / "cpu.yaml").read_text() + textwrap.dedent("""\
        dynamo_config:
          dynamo_backend: INDUCTOR
          dynamo_use_regional_compilation: true
        """))
    profile = load_profile(str(path))
    for engine in ("ddp", "fsdp", "single", "dp"):
        env = plan_launch(profile, engine, ["train.py"], gpus=0).env
        assert (env["ACCELERATE_DYNAMO_BACKEND"], env["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"]) == \
            ("INDUCTOR", "True"), engine
    assert not any(k.startswith("ACCELERATE_DYNAMO") for k in
                   plan_launch(load_profile(str(CONFIGS / "cpu.yaml")), "ddp", ["train.py"], gpus=0).env)
