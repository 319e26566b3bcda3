"""`toolkit export CHECKPOINT --format onnx|torchscript|safetensors [--out PATH]`: a recipe's trained model as a
file other programs load, checked against PyTorch before it is kept.

    toolkit export runs/digits/checkpoints --format onnx
    # wrote runs/digits/export/step-00000046.onnx (torch.onnx dynamo exporter, any batch size) and its
    # preprocessing in step-00000046.onnx.json; onnxruntime vs PyTorch on random batches of 2 and 3: max abs
    # difference 1.1e-07 (limit 1e-04)

onnx: torch.onnx.export (the dynamo exporter; the TorchScript-based one where it fails), input `images`
(batch x 3 x S x S, the batch dimension dynamic), output `logits`, run with onnxruntime. torchscript:
torch.jit.trace, saved with torch.jit.save and loaded back. safetensors: the weights alone, with the model name,
image size, classes and normalisation in the file's metadata, loadable with recipes/images.py --weights. Each
export is compared with the PyTorch model on the same random inputs and removed when any logit differs by more
than 1e-4 (exit 1). Beside each, PATH.json says what a user must do to an image first (size, mean, std) and
what the outputs are (class names, logits).
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch

from toolkit.checkpoint.folder import STEP_FOLDER
from toolkit.checkpoint.weights import honour_umask, load_model
from toolkit.errors import RunFailure, UserError
from toolkit.use.model import TrainedModel, load_trained_model

FORMATS = {"onnx": ".onnx", "torchscript": ".pt", "safetensors": ".safetensors"}
TOLERANCE = 1e-4  # fp32 kernels of two runtimes differ by ~1e-7 per logit; 1e-4 is a wrong graph, not noise
CHECK_BATCHES = (2, 3)  # two sizes: a batch dimension fixed at export time fails the second


def default_out(checkpoint: Path, kind: str) -> Path:
    """RUN_DIR/export/step-N.EXT for a checkpoint under RUN_DIR/checkpoints, else export/ beside the folder.

    >>> default_out(Path("runs/x/checkpoints/step-00000046"), "onnx").as_posix()
    'runs/x/export/step-00000046.onnx'
    """
    base = checkpoint.parent.parent if STEP_FOLDER.fullmatch(checkpoint.name) else checkpoint.parent
    return base / "export" / f"{checkpoint.name}{FORMATS[kind]}"


@torch.inference_mode()
def max_difference(run, model, image_size: int) -> float:
    """The largest |run(x) - model(x)| over random batches of CHECK_BATCHES images (the same inputs to both).

    >>> net = torch.nn.Conv2d(3, 2, 3)
    >>> max_difference(net, net, image_size=8)
    0.0
    """
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for n in CHECK_BATCHES:
        images = torch.randn(n, 3, image_size, image_size, generator=generator)
        worst = max(worst, (torch.as_tensor(run(images)) - model(images)).abs().max().item())
    return worst


def export_onnx(trained: TrainedModel, out: Path) -> tuple[float, str]:
    """Write the ONNX graph, a dynamic batch dimension; the difference from PyTorch under onnxruntime."""
    try:
        import onnx  # noqa: F401  (the exporters need it; imported here for the sentence below)
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise UserError(f"ONNX export needs onnx, onnxscript and onnxruntime ({error.name} is not installed); "
                        "install them with pip install \"toolkit[export]\".") from None
    example = torch.zeros(CHECK_BATCHES[0], 3, trained.image_size, trained.image_size)
    names = {"input_names": ["images"], "output_names": ["logits"]}
    # One file, unless protobuf's 2 GiB limit forces the weights into OUT.data beside it.
    large = sum(t.numel() * t.element_size() for t in trained.model.state_dict().values()) > 2**31 - 2**26
    try:
        torch.onnx.export(trained.model, (example,), str(out), dynamo=True, verbose=False, external_data=large,
                          dynamic_shapes=({0: torch.export.Dim("batch")},), **names)
        how = "torch.onnx dynamo exporter"
    except Exception as dynamo_error:  # an operator torch.export cannot trace: the TorchScript-based exporter
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # its deprecation notice: the dynamo exporter was tried first
                torch.onnx.export(trained.model, (example,), str(out), dynamo=False, **names,
                                  dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}})
        except Exception as error:
            raise RunFailure(f"torch.onnx could not export {trained.name} (dynamo: {_first_line(dynamo_error)}; "
                             f"TorchScript-based: {_first_line(error)}).") from None
        how = "torch.onnx TorchScript-based exporter, the dynamo one failed"
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return max_difference(lambda x: session.run(None, {"images": x.numpy()})[0], trained.model,
                          trained.image_size), how


def export_torchscript(trained: TrainedModel, out: Path) -> tuple[float, str]:
    """Trace and save the model; the difference from PyTorch of the file loaded back."""
    example = torch.zeros(CHECK_BATCHES[0], 3, trained.image_size, trained.image_size)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch marks torch.jit deprecated; asked for
        torch.jit.save(torch.jit.trace(trained.model, example), str(out))
        loaded = torch.jit.load(str(out), map_location="cpu")
    return max_difference(loaded, trained.model, trained.image_size), "torch.jit.trace"


def export_safetensors(trained: TrainedModel, out: Path) -> tuple[float, str]:
    """The weights alone, the model's description in the metadata; the difference from PyTorch of a copy of
    the model whose every tensor was zeroed, then loaded from the file (strictly: every name and shape)."""
    import safetensors.torch

    p = trained.preprocessing
    metadata = {"format": "pt", "model": trained.name, "image_size": str(trained.image_size),
                "classes": json.dumps(trained.classes), "resize_shorter_side": str(p.resize),
                "mean": json.dumps(list(p.mean)), "std": json.dumps(list(p.std))}
    safetensors.torch.save_model(trained.model, str(out), metadata=metadata)  # tied weights stored once
    honour_umask(out)
    twin = copy.deepcopy(trained.model)
    with torch.no_grad():
        for tensor in twin.state_dict().values():
            tensor.zero_()
    load_model(twin, out)
    return max_difference(twin, trained.model, trained.image_size), "safetensors with metadata"


EXPORTERS = {"onnx": (export_onnx, "onnxruntime"), "torchscript": (export_torchscript, "the loaded TorchScript"),
             "safetensors": (export_safetensors, "the weights reloaded")}


def describe(trained: TrainedModel, kind: str, out: Path, how: str, difference: float) -> dict:
    """What PATH.json says: the input a user must prepare, the outputs, and how the file was checked."""
    size = trained.image_size
    return {"file": out.name, "format": kind, "exported_with": how, "model": trained.name,
            "checkpoint": str(trained.checkpoint), "step": trained.step,
            "input": {"name": "images", "shape": ["batch", 3, size, size], "dtype": "float32"},
            "preprocessing": trained.preprocessing.as_dict(),
            "output": {"name": "logits", "shape": ["batch", len(trained.classes)],
                       "meaning": "one logit per class, in the order of classes; softmax gives probabilities"},
            "classes": trained.classes,
            "checked": {"against": "PyTorch, the same random inputs", "batch_sizes": list(CHECK_BATCHES),
                        "max_abs_difference": difference, "tolerance": TOLERANCE}}


def export(checkpoint, kind: str, out=None, average: bool = False) -> tuple[Path, dict]:
    """Export the model of `checkpoint` (with `average`, its weight average) as `kind` to `out` (default_out when
    None), check it against PyTorch, and write its description beside it as OUT.json; returns (out, the
    description)."""
    if kind not in FORMATS:
        raise UserError(f"Unknown export format {kind!r}; choose one of {', '.join(FORMATS)} with --format.")
    trained = load_trained_model(checkpoint, average=average)
    out = Path(out) if out else default_out(trained.checkpoint, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    exporter, compared = EXPORTERS[kind]
    difference, how = exporter(trained, out)
    if not difference <= TOLERANCE:  # NaN included
        out.unlink(missing_ok=True)
        raise RunFailure(f"The {kind} export of {trained.checkpoint} gives logits {difference:.2g} away from PyTorch's "
                         f"on the same inputs (more than {TOLERANCE:g}) under {compared}; nothing was kept.")
    about = describe(trained, kind, out, how, difference)
    sidecar = out.with_name(out.name + ".json")
    sidecar.write_text(json.dumps(about, indent=1) + "\n")
    return out, about


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)[:160]


def run_export(args) -> int:
    """`toolkit export CHECKPOINT --format onnx|torchscript|safetensors [--out PATH]`."""
    out, about = export(args.checkpoint, args.format, args.out, average=args.average)
    print(f"wrote {out} ({about['exported_with']}; {about['model']}, {len(about['classes'])} classes, "
          f"{about['input']['shape'][2]}x{about['input']['shape'][3]} inputs) and its preprocessing in "
          f"{out.name}.json; {EXPORTERS[args.format][1]} vs PyTorch on random batches of "
          f"{' and '.join(map(str, CHECK_BATCHES))}: max abs difference {about['checked']['max_abs_difference']:.1e} "
          f"(limit {TOLERANCE:.0e})")
    return 0
