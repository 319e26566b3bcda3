"""The `toolkit` command.

    toolkit launch --config_file accelerate_configs/multi_gpu.yaml [--engine ddp] script.py [args ...]
    toolkit parity A.yaml B.yaml [--engine-a E] [--engine-b E] [--steps K] -- script.py [args ...]
    toolkit env [--config_file accelerate_configs/cpu.yaml] [--json]
    toolkit compare RUN_DIR [RUN_DIR ...] [--plot compare.png]
    toolkit checkpoint consolidate CHECKPOINT [--out PATH]
    toolkit predict CHECKPOINT IMAGES...|FOLDER [--top-k 5] [--batch-size 64] [--device auto] [--out FILE.csv|.json]
    toolkit export CHECKPOINT --format onnx|torchscript|safetensors [--out PATH]
    toolkit plan [--recipe cifar|images|lm] [--model M] [--global-batch-size G] [--device here|H100|...] [--memory GiB]
"""

from __future__ import annotations

import argparse
import sys

from toolkit.config import StrictParser, with_suggestion
from toolkit.engines import ENGINES
from toolkit.errors import RunFailure, report
from toolkit.launch.engine_specs import LAUNCH_DEFAULT


def _launch_parser(sub):
    p = sub.add_parser("launch", help="start a script under an engine with an accelerate profile")
    p.add_argument("--config_file", "--config-file", required=True, help="accelerate YAML profile")
    p.add_argument("--engine", choices=sorted(ENGINES), help=f"default: TOOLKIT_ENGINE, else {LAUNCH_DEFAULT}")
    p.add_argument("--num_processes", "--num-processes", type=int, help="override the profile (all machines)")
    p.add_argument("--machine_rank", "--machine-rank", type=int, help="this machine's rank (multi-node)")
    p.add_argument("--main_process_port", "--main-process-port", type=int, help="override the profile's port")
    p.add_argument("--max_restarts", "--max-restarts", type=int,
                   help="restart the worker group this many times after a failure (the script resumes; default 0, "
                        "3 with --nnodes MIN:MAX)")
    p.add_argument("--nnodes", metavar="MIN:MAX", help="elastic: carry on with as few as MIN machines when some are "
                   "lost, and grow again up to MAX (the profile's num_machines by default) when they come back")
    p.add_argument("--rdzv_last_call", "--rdzv-last-call", type=float, default=30.0, metavar="S",
                   help="elastic: once MIN machines are there, seconds to wait for more before training (default 30)")
    p.add_argument("--rdzv_keep_alive", "--rdzv-keep-alive", type=int, default=5, metavar="S",
                   help="elastic: each machine's agent tells the rendezvous it is alive every S seconds, and one "
                        "silent for 3 of them is dropped, so a lost machine's peers go on after 3 x S (default 5)")
    p.add_argument("--rdzv_timeout", "--rdzv-timeout", type=float, default=300.0,
                   help="seconds the machines of a multi-node job wait for each other before giving up")
    for dim in ("dp_replicate", "dp_shard", "tp", "cp", "pp"):  # accelerate launch's names, over the profile's
        p.add_argument(f"--parallelism_config_{dim}_size", f"--parallelism-config-{dim.replace('_', '-')}-size",
                       type=int, metavar="N", help=f"the device mesh's {dim} size (Accelerate's ParallelismConfig; "
                       f"pp the toolkit's own)" if dim == "pp" else f"the device mesh's {dim} size (Accelerate's "
                       f"ParallelismConfig)")
    p.add_argument("--parallelism_config_pp_schedule", "--parallelism-config-pp-schedule", choices=("1f1b", "gpipe"),
                   help="the pipeline's schedule (default 1f1b)")
    p.add_argument("--parallelism_config_pp_microbatches", "--parallelism-config-pp-microbatches", type=int,
                   metavar="M", help="the slices a pipeline splits each batch into (default: the pp size)")
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the command and environment only")
    p.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args ...]")


class _OptionsThenScript(argparse.Action):
    """The script and its arguments (argparse.REMAINDER), after this command's own options and `--`:
    `toolkit parity A.yaml B.yaml --steps 3 -- script.py --steps 9` gives the script its own --steps."""

    def __init__(self, *args, options: argparse.ArgumentParser, **kwargs):
        super().__init__(*args, nargs=argparse.REMAINDER, **kwargs)
        self.options = options

    def __call__(self, parser, namespace, values, option_string=None):
        if "--" in values:
            cut = values.index("--")
            self.options.parse_args(values[:cut], namespace)
            values = values[cut + 1:]
        elif values and values[0].startswith("-"):
            parser.error(f"put `--` between the options of `{parser.prog}` and the script")
        setattr(namespace, self.dest, values)


def _parity_parser(sub):
    options = _Parser(add_help=False, prog="toolkit parity")
    for side in "ab":
        options.add_argument(f"--engine-{side}", f"--engine_{side}", choices=sorted(ENGINES), default=LAUNCH_DEFAULT,
                             help=f"engine of run {side.upper()} (default: {LAUNCH_DEFAULT})")
        options.add_argument(f"--num-processes-{side}", f"--num_processes_{side}", type=int, metavar="N",
                             help=f"override the processes of {side.upper()}.yaml (all machines)")
        options.add_argument(f"--args-{side}", f"--args_{side}", default="", metavar="ARGS",
                             help=f"script arguments for run {side.upper()} only, e.g. --args-{side}=\"--micro-batch-size 16\"")
    options.add_argument("--steps", type=int, default=10, help="optimizer steps to compare (default: 10)")
    # fp32 summation-order noise between two splits of a batch is ~1e-7 relative; 1e-5 leaves room for K steps.
    options.add_argument("--tolerance", type=float, default=1e-5,
                         help="agreement: |A-B| <= tolerance x (1 + |A|) on every loss and weight (default: 1e-5)")
    options.add_argument("--output-dir", "--output_dir", help="keep each run's record, weights and log here")
    p = sub.add_parser("parity", parents=[options], help="run a script under two setups for K steps and compare "
                       "losses and weights (exit 0 agree, 3 expected difference, 1 unexplained difference)")
    p.add_argument("config_a", metavar="A.yaml", help="accelerate profile of run A")
    p.add_argument("config_b", metavar="B.yaml", help="accelerate profile of run B")
    p.add_argument("script", action=_OptionsThenScript, options=options, help="-- script.py [args ...]")


def _env_parser(sub):
    p = sub.add_parser("env", help="show versions, devices, the engine and topology a profile implies, and "
                       "every mismatch visible before launching (exit 1 when one would stop the launch)")
    p.add_argument("--config_file", "--config-file", help="accelerate YAML profile (default: accelerate's own)")
    p.add_argument("--json", action="store_true", help="machine-readable output with stable keys")


def _compare_parser(sub):
    p = sub.add_parser("compare", help="overlay runs' loss and accuracy against images seen (PNG) and print a table "
                       "of engine, processes, global batch, micro-batch x accumulation, accuracy, images/s")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="--output-dir of finished recipe runs")
    p.add_argument("--plot", default="compare.png", help="where to write the PNG (default: compare.png)")


def _checkpoint_parser(sub):
    p = sub.add_parser("checkpoint", help="work on a recipe's checkpoints")
    actions = p.add_subparsers(dest="action", required=True, parser_class=_Parser)
    c = actions.add_parser("consolidate", help="turn a sharded checkpoint (--checkpoint-format sharded) into a "
                           "full one that resumes under every engine, or into one safetensors file of weights")
    c.add_argument("checkpoint", help="a step-N folder, or a checkpoints folder (its latest)")
    c.add_argument("--out", help="a folder: a full checkpoint lands in OUT/step-N; a *.safetensors file: the weights "
                   "alone (default: the checkpoints folder's sibling CHECKPOINTS-full)")


def _predict_parser(sub):
    p = sub.add_parser("predict", help="the top-k classes of image files with their probabilities, from a checkpoint "
                       "(full or sharded, any engine), as CSV or JSON; on an ImageFolder split also the accuracy")
    p.add_argument("checkpoint", help="a step-N folder, or a checkpoints folder (its latest)")
    p.add_argument("inputs", nargs="+", metavar="IMAGE|FOLDER",
                   help="image files, or folders walked recursively for them (sorted)")
    p.add_argument("--top-k", "--top_k", type=int, default=5, metavar="K",
                   help="classes per image, most probable first (default: 5; at most the class count)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=64, metavar="N",
                   help="images per forward pass (default: 64)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                   help="where the model runs (default: auto, cuda when available)")
    p.add_argument("--out", metavar="FILE", help="FILE.csv (path, class_1, prob_1, ...) or FILE.json (a list of "
                   "objects) (default: CSV to stdout, the accuracy line to stderr)")
    p.add_argument("--average", action="store_true", help="the run's weight average (trained with --ema-decay) "
                   "instead of its weights")


def _export_parser(sub):
    p = sub.add_parser("export", help="write a checkpoint's model as ONNX, TorchScript or safetensors, checked "
                       "against PyTorch on the same inputs (exit 1 above 1e-4), its preprocessing in OUT.json")
    p.add_argument("checkpoint", help="a step-N folder, or a checkpoints folder (its latest)")
    p.add_argument("--format", required=True, choices=("onnx", "torchscript", "safetensors"),
                   help="onnx (onnxruntime-checked), torchscript (torch.jit.trace), or safetensors (the weights "
                   "with their metadata, loadable with --weights)")
    p.add_argument("--out", metavar="PATH", help="the file to write (default: RUN_DIR/export/step-N.onnx|.pt|"
                   ".safetensors beside the checkpoints folder)")
    p.add_argument("--average", action="store_true", help="the run's weight average (trained with --ema-decay) "
                   "instead of its weights")


def _plan_parser(sub):
    # Flags only: `toolkit plan` imports torch when it runs (a Ctrl-C while the launcher imports it stays one line).
    p = sub.add_parser("plan", help="predict each setup's per-rank peak memory and step time for a recipe's model "
                       "and global batch, mark what does not fit, recommend the fastest that does")
    p.add_argument("--recipe", choices=("cifar", "images", "lm"), default="cifar", help="the recipe whose model and "
                   "loss are planned (default: cifar)")
    p.add_argument("--model", help="the recipe's --model (default: the recipe's)")
    p.add_argument("--global-batch-size", "--global_batch_size", type=int, metavar="G",
                   help="samples per optimizer step over every process (default: the model's preset's)")
    p.add_argument("--device", default="here", help="'here' (this machine, measured once and cached) or a GPU named "
                   "in toolkit/train/cost.py's PEAK_TFLOPS: H200, H100, A100, L40S, A10G, L4, V100, T4")
    p.add_argument("--memory", type=float, metavar="GIB", help="memory one rank may hold, GiB (with --peak-tflops: "
                   "a GPU given by its figures)")
    p.add_argument("--peak-tflops", "--peak_tflops", type=float, metavar="T", help="with --memory: the GPU's peak")
    p.add_argument("--processes", default=None, metavar="N,N,...", help="world sizes to plan (default: 1,2,4; "
                   "1,2,4,8 on a GPU)")
    p.add_argument("--margin", type=float, default=0.10, help="share of the memory kept free (default: 0.10, the "
                   "peak's stated error)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="default: the model's preset's")
    p.add_argument("--image-size", "--image_size", type=int, help="images recipes: pixels per side")
    p.add_argument("--block-size", "--block_size", type=int, help="lm: tokens per sequence")
    p.add_argument("--json", action="store_true", help="the rows as JSON, the recommended one first")


class _Parser(StrictParser):
    def error(self, message):  # one line and exit 2, like every other user error here
        self.exit(2, f"error: {with_suggestion(self, message)} (see `toolkit --help`)\n")


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The parser of the (sub)command that `args` chose: `toolkit checkpoint consolidate` -> consolidate's."""
    while chosen := next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None):
        parser = chosen.choices[getattr(args, chosen.dest)]
    return parser


def main(argv=None) -> int:
    parser = _Parser(prog="toolkit", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _launch_parser(sub)
    _parity_parser(sub)
    _env_parser(sub)
    _compare_parser(sub)
    _checkpoint_parser(sub)
    _predict_parser(sub)
    _export_parser(sub)
    _plan_parser(sub)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the (sub)command's own parser, which knows the flag meant
        _command_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "launch":
            from toolkit.launch.launcher import launch

            return launch(args)
        if args.command == "parity":
            from toolkit.check.parity import run_parity

            return run_parity(args)
        if args.command == "env":
            from toolkit.check.env import run_env

            return run_env(args)
        if args.command == "compare":
            from toolkit.check.compare import run_compare

            return run_compare(args)
        if args.command == "checkpoint":
            from toolkit.checkpoint.consolidate import run_consolidate

            return run_consolidate(args)
        if args.command == "predict":
            from toolkit.use.predict import run_predict

            return run_predict(args)
        if args.command == "export":
            from toolkit.use.export import run_export

            return run_export(args)
        if args.command == "plan":
            from toolkit.plan.command import run_plan

            return run_plan(args)
    except RunFailure as error:  # UserError included: one sentence, its own exit code
        return report(error)
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
