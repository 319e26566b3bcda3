"""Model throughput: training images/s of the fast net (resnet9) and ResNet-18 as bf16, channels_last
and torch.compile are switched on one after another.

    python benchmarks/model_throughput.py --device cuda            # a GPU machine: both models, under 5 minutes
    python benchmarks/model_throughput.py --device cuda --quick    # a GPU machine: a minute or two, mostly compiling
    python benchmarks/model_throughput.py --device cpu --quick     # no GPU: the tiny net, exercises the code (CI)

Per model, four configurations of the same initial weights, each adding one switch to the one before:
fp32 (eager), + bf16 autocast, + channels_last, + torch.compile. Each is warmed up (compiling happens
there), then all four are timed in interleaved rounds on the same batch (random images already on the
device: this is the model's speed, not the loader's). Every ratio is a configuration's images/s over
fp32's, measured in the same run. Without CUDA, `--device cuda` exits 2. On the CPU, --quick compiles
with the aot_eager backend: inductor would spend ~30 s generating C++ for a few milliseconds of work.
"""

from __future__ import annotations

import time

import common
import torch
import torch.nn.functional as F

from toolkit.errors import UserError
from toolkit.models.nets import MODELS, build_model

# name: (bf16, channels_last, compile); each adds one switch to the previous line.
CONFIGS = {"fp32": (False, False, False), "+ bf16": (True, False, False),
           "+ channels_last": (True, True, False), "+ compile": (True, True, True)}
BASELINE = "fp32"


def parse_args(argv=None):
    parser = common.build_parser("model_throughput", __doc__)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda")
    parser.add_argument("--models", default=None, help="comma-separated, from " + ", ".join(MODELS) +
                        " (default resnet9,resnet18; --quick on the CPU: tiny)")
    parser.add_argument("--batch-size", type=int, default=None, help="default 512 on a GPU (256 --quick), 32 on the CPU (8 --quick)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend (default inductor; "
                        "aot_eager for --quick on the CPU)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="skip configurations not started within "
                        "this many seconds, so a run ends within about 5 minutes (default %(default)s)")
    args = parser.parse_args(argv)
    gpu, quick = args.device == "cuda", args.quick
    args.models = (args.models or ("tiny" if quick and not gpu else "resnet9,resnet18")).split(",")
    args.batch_size = args.batch_size or {(True, False): 512, (True, True): 256, (False, False): 32,
                                          (False, True): 8}[(gpu, quick)]
    args.compile_backend = args.compile_backend or ("aot_eager" if quick and not gpu else "inductor")
    args.rounds, args.block_s = (2, 0.1) if quick else (5, 0.5)
    if [m for m in args.models if m not in MODELS] or args.batch_size < 1 or args.budget_s <= 0:
        raise UserError(f"--models takes names from {', '.join(MODELS)} (got {','.join(args.models)}); "
                        "--batch-size and --budget-s must be positive.")
    if gpu and not torch.cuda.is_available():
        raise UserError("--device cuda needs a CUDA GPU and torch sees none; use --device cpu --quick to "
                        "exercise this script without one.")
    return args


def train_step(model, x, y, bf16: bool):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)

    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_config(config: str, model_name: str, weights: dict, x, y, backend: str):
    """A fresh model with `weights`, set up as `config` says, and its training step."""
    bf16, channels_last, compiled = CONFIGS[config]
    model = build_model(model_name, num_classes=10).to(x.device)
    model.load_state_dict(weights)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    if compiled:
        model = torch.compile(model, backend=backend)
    return train_step(model, x, y, bf16)


def measure_model(name: str, args, sync, deadline: float):
    """Build, warm up and time the configurations of one model that start before `deadline`
    (time.perf_counter); return rows, ratios and the configurations skipped."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    weights = build_model(name, 10).state_dict()
    x = torch.randn(args.batch_size, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (args.batch_size,), device=device)
    steps, warmup_s = {}, {}
    for config in CONFIGS:
        if time.perf_counter() > deadline:
            continue
        start = time.perf_counter()
        steps[config] = build_config(config, name, weights, x, y, args.compile_backend)
        for _ in range(3):  # compiles here, and lets cudnn.benchmark pick its kernels
            steps[config]()
        sync()
        warmup_s[config] = time.perf_counter() - start
    if BASELINE not in steps:
        return [], [], [name]
    n = common.calls_for(steps[BASELINE], args.block_s, sync)
    blocks = {config: lambda step=step: [step() for _ in range(n)] for config, step in steps.items()}
    times = common.time_interleaved(blocks, args.rounds, sync)
    print(f"{name}: batch {args.batch_size}, {n} steps per configuration per round, {args.rounds} rounds on {device}")
    rows, ratios = [], []
    for config in steps:
        ratio = common.paired_ratio(times, config, over=BASELINE)
        if config != BASELINE:
            ratios.append(common.Ratio(f"{name} {config} / {BASELINE}", ratio))
        rows.append([name, config, args.batch_size, common.per_second(args.batch_size * n, times[config]),
                     f"{ratio:.2f}", f"{warmup_s[config]:.1f}"])
    return rows, ratios, [f"{name} {config}" for config in CONFIGS if config not in steps]


def main(argv=None) -> int:
    args = parse_args(argv)
    out = common.prepare_out(args.out)
    gpu = args.device == "cuda"
    sync = torch.cuda.synchronize if gpu else lambda: None
    torch.backends.cudnn.benchmark = True
    started, rows, ratios, skipped = time.perf_counter(), [], [], []
    for name in args.models:
        model_rows, model_ratios, model_skipped = measure_model(name, args, sync, started + args.budget_s)
        rows, ratios, skipped = rows + model_rows, ratios + model_ratios, skipped + model_skipped
        if gpu:
            torch.cuda.empty_cache()
    notes = [
        (f"each line adds one switch to the line above; compile is torch.compile(model, "
         f"backend={args.compile_backend!r}); warm-up s includes compiling."),
        f"all configurations timed in the same run, {time.perf_counter() - started:.0f} s in all.",
    ]
    notes += [f"skipped {', '.join(skipped)}: the {args.budget_s:g} s budget (--budget-s) was spent before they started."] if skipped else []
    columns = ["model", "configuration", "batch", "images/s (median)", f"ratio to {BASELINE}", "warm-up s"]
    bars = common.Bars([f"{r[0]} {r[1]}" for r in rows], [r[3] for r in rows],
                       "training images/s (median over rounds)", [f"{r[4]}x" for r in rows])
    common.publish(out, "model_throughput", f"Model throughput on {args.device}: bf16, channels_last, torch.compile",
                   (columns, rows), ratios, notes, bars)
    return 0


if __name__ == "__main__":
    common.run_main(main)
