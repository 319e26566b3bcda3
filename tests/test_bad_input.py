"""Every mistake a user can make gets one clear sentence and exit code 2, never a traceback.

One table, run in-process through the same entry points the commands use (`toolkit.cli.main` and the
recipe's `main`), so 30-odd cases cost seconds; a few are also run as real processes to prove the
one-line-and-exit-2 contract end to end (see test_real_processes_print_one_line_and_exit_2).
"""

import importlib.util
import pickle
import socket

import numpy as np
import pytest

from conftest import CONFIGS, PY, ROOT, TOOLKIT, run
from hostile import CreatesFileOnLoad
from toolkit import cli
from toolkit.checkpoint.functional import save_checkpoint
from toolkit.errors import UserError
from toolkit.models.nets import build_model

spec = importlib.util.spec_from_file_location("cifar_recipe", ROOT / "recipes" / "cifar.py")
cifar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cifar)

MULTI_GPU = str(CONFIGS / "multi_gpu.yaml")
MULTI_NODE = str(CONFIGS / "multi_node.yaml")
PROFILE_HEAD = "compute_environment: LOCAL_MACHINE\nmixed_precision: 'no'\nuse_cpu: true\n"


def profile(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def cifar_folder(tmp_path, *, labels=None, skip_test=False):
    folder = tmp_path / "cifar" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    files = [f"data_batch_{i}" for i in range(1, 6)] + ([] if skip_test else ["test_batch"])
    for name in files:
        batch = {b"data": np.zeros((4, 3072), np.uint8), b"labels": labels or [0, 1, 2, 3]}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return str(tmp_path / "cifar")


def other_model_checkpoint(tmp_path):
    model = build_model("resnet9", 10)
    state = {"step": 1, "epoch": 0, "samples_in_epoch": 0, "world_size": 1, "config": {"model": "resnet9"}}
    return str(save_checkpoint(tmp_path / "ckpt", 1, model=model, state=state))


def busy_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


LAUNCH_CASES = {  # name -> (args after `toolkit launch` given tmp_path, words the sentence holds)
    "profile path that does not exist": (lambda t: ["--config_file", "nope.yaml"], "no accelerate profile at nope.yaml"),
    "YAML that is not YAML": (lambda t: ["--config_file", profile(t, "a: [b\n")], "is not valid YAML"),
    "a key accelerate does not know": (lambda t: ["--config_file", profile(t, PROFILE_HEAD + "distributed_type: 'NO'\nnum_processes: 1\nbogus: 1\n")], "unknown keys"),
    "no distributed_type": (lambda t: ["--config_file", profile(t, "num_processes: 1\n")], "distributed_type"),
    "num_processes 0 on the command line": (lambda t: ["--config_file", MULTI_GPU, "--num_processes", "0"], "num_processes must be at least 1"),
    "num_processes negative in the profile": (lambda t: ["--config_file", profile(t, PROFILE_HEAD + "distributed_type: MULTI_GPU\nnum_processes: -3\n")], "at least 1"),
    "num_processes not a multiple of machines": (lambda t: ["--config_file", MULTI_NODE, "--num_processes", "3"], "multiple of num_machines"),
    "machine_rank >= num_machines": (lambda t: ["--config_file", MULTI_NODE, "--machine_rank", "2"], "machine_rank 2 is outside 0..1"),
    "several machines without main_process_ip": (lambda t: ["--config_file", profile(t, PROFILE_HEAD + "distributed_type: MULTI_GPU\nnum_processes: 4\nnum_machines: 2\n")], "main_process_ip"),
    "port out of range": (lambda t: ["--config_file", MULTI_GPU, "--main_process_port", "70000"], "outside 0..65535"),
    "unknown rendezvous backend": (lambda t: ["--config_file", profile(t, PROFILE_HEAD + "distributed_type: MULTI_GPU\nnum_processes: 2\nrdzv_backend: etcd\n")], "rdzv_backend must be static or c10d"),
    "unknown engine": (lambda t: ["--config_file", MULTI_GPU, "--engine", "horovod"], "invalid choice: 'horovod'"),
    "dp asked for with several processes": (lambda t: ["--config_file", MULTI_GPU, "--engine", "dp", "--num_processes", "2"], "dp engine drives every GPU from one process"),
    "no script": (lambda t: ["--config_file", MULTI_GPU], "no script given"),
    "script that does not exist": (lambda t: ["--config_file", MULTI_GPU, "nope.py"], "no script at nope.py"),
    "negative max_restarts": (lambda t: ["--config_file", MULTI_GPU, "--max_restarts", "-1"], "--max_restarts must be at least 0"),
}


@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_launch_input(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    args, words = LAUNCH_CASES[case]
    argv = ["launch", *args(tmp_path)]
    if "--config_file" in argv and argv[-1] not in ("nope.py",) and case not in ("no script",):
        argv.append("train.py")
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and words in err, err


def test_port_in_use(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    sock, port = busy_port()
    with sock:
        code = cli.main(["launch", "--config_file", MULTI_GPU, "--engine", "ddp", "--main_process_port", str(port),
                         "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and f"port {port} on 127.0.0.1 is already in use" in err, err


RECIPE_CASES = {  # name -> (flags given tmp_path, words the sentence holds)
    "global batch 0": (lambda t: ["--global-batch-size", "0"], "--global-batch-size and --micro-batch-size must be at least 1, not 0"),
    "global batch that does not split": (lambda t: ["--global-batch-size", "63", "--micro-batch-size", "2"],
                                         "--micro-batch-size 2 does not divide the 63 images each of the 1 process(es)"),
    "epochs 0": (lambda t: ["--epochs", "0"], "--epochs must be at least 1"),
    "micro batch 0": (lambda t: ["--micro-batch-size", "0"], "must be at least 1, not 64 and 0"),
    "warmup of 1": (lambda t: ["--warmup", "1"], "--warmup and --label-smoothing in [0, 1)"),
    "unknown augmentation": (lambda t: ["--augment", "mixup"], "invalid choice: 'mixup'"),
    "keep 0": (lambda t: ["--keep", "0"], "--keep must be at least 1"),
    "negative lr": (lambda t: ["--lr", "-1"], "--lr and --timeout positive"),
    "zero timeout": (lambda t: ["--timeout", "0"], "--lr and --timeout positive"),
    "max steps 0": (lambda t: ["--max-steps", "0"], "--max-steps must be at least 1"),
    "unknown dataset": (lambda t: ["--dataset", "imagenet"], "Unknown dataset 'imagenet'"),
    "hf: with no name": (lambda t: ["--dataset", "hf:"], "Unknown dataset 'hf:'"),
    "hf folder of something else": (lambda t: ["--dataset", f"hf:{t}"], "neither a save_to_disk dataset nor .parquet"),
    "CIFAR folder without test_batch": (lambda t: ["--dataset", "cifar10", "--data-dir", cifar_folder(t, skip_test=True)], "test_batch"),
    "labels out of range": (lambda t: ["--dataset", "cifar10", "--data-dir", cifar_folder(t, labels=[0, 1, 2, 10])], "outside"),
    "resume path that does not exist": (lambda t: ["--resume", str(t / "nope")], "does not exist"),
    "checkpoint from a different model": (lambda t: ["--resume", other_model_checkpoint(t)],
                                          lambda t: f"{t / 'ckpt' / 'step-00000001'} holds a resnet9 model, not tiny; "
                                                    "pick another --output-dir."),
    "fp16 on CPU": (lambda t: ["--mixed-precision", "fp16"], "fp16 mixed precision needs a CUDA device"),
    "batch larger than the training set": (lambda t: ["--global-batch-size", "100000"], "of one micro-step over all processes"),
    "unknown model": (lambda t: ["--model", "vit"], "invalid choice: 'vit'"),
    "unknown engine": (lambda t: ["--engine", "horovod"], "invalid choice: 'horovod'"),
    "unknown loader": (lambda t: ["--loader", "ffcv"], "invalid choice: 'ffcv'"),
    "not a number": (lambda t: ["--lr", "fast"], "invalid float value: 'fast'"),
    "output folder holding another run": (lambda t: ["--output-dir", used_folder(t)], "--resume auto, or pass a fresh folder"),
    "pickle that runs code": (lambda t: ["--dataset", "cifar10", "--data-dir", evil_cifar_folder(t)], "which a dataset file never needs"),
}


def used_folder(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("{}\n")
    return str(tmp_path / "used")


def evil_cifar_folder(tmp_path):
    folder = cifar_folder(tmp_path)
    with open(f"{folder}/cifar-10-batches-py/data_batch_1", "wb") as f:
        pickle.dump({b"data": CreatesFileOnLoad(tmp_path / "evil-pickle-ran"), b"labels": [0]}, f)
    return folder


@pytest.mark.parametrize("case", sorted(RECIPE_CASES))
def test_recipe_input(case, tmp_path, capsys):
    flags, words = RECIPE_CASES[case]
    words = words(tmp_path) if callable(words) else words
    argv = ["--dataset", "synthetic", "--model", "tiny", "--output-dir", str(tmp_path / "out"), *flags(tmp_path)]
    with pytest.raises((UserError, SystemExit)) as raised:
        cifar.main(argv)
    if raised.type is SystemExit:  # argparse: one line on stderr, exit 2
        err = capsys.readouterr().err
        assert raised.value.code == 2 and err.count("\n") == 1 and words in err, err
    else:
        message = str(raised.value)
        assert words in message and "\n" not in message, message
    assert not (tmp_path / "out" / "summary.json").exists()


def test_there_are_at_least_25_cases():
    """Counts the cases pytest collects from this module (whatever -k selected in this session), not the
    tables' keys, and the distinct sentences they expect: a second case with the same guard's words is not
    another case."""
    listed = run([PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", __file__]).stdout
    tables = ("::test_launch_input[", "::test_recipe_input[", "::test_port_in_use")
    cases = [line for line in listed.splitlines() if any(table in line for table in tables)]
    distinct = {("launch", words) for _, words in LAUNCH_CASES.values()}
    distinct |= {("recipe", words if isinstance(words, str) else name) for name, (_, words) in RECIPE_CASES.items()}
    assert len(cases) >= 25 and len(distinct) + 1 >= 25, (len(cases), len(distinct))


@pytest.mark.parametrize("command", [
    [PY, "recipes/cifar.py", "--dataset", "synthetic", "--model", "tiny", "--global-batch-size", "0"],
    TOOLKIT + ["launch", "--config_file", "nope.yaml", "train.py"],
])
def test_real_processes_print_one_line_and_exit_2(command):
    proc = run(command, check=False, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.strip()][0].startswith("error: ")
