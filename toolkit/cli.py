"""The `toolkit` command.

    toolkit launch --config_file accelerate_configs/multi_gpu.yaml [--engine ddp] script.py [args ...]
"""

from __future__ import annotations

import argparse
import sys

from toolkit.engines import ENGINES
from toolkit.errors import UserError, report


def _launch_parser(sub):
    p = sub.add_parser("launch", help="start a script under an engine with an accelerate profile")
    p.add_argument("--config_file", "--config-file", required=True, help="accelerate YAML profile")
    p.add_argument("--engine", choices=sorted(ENGINES), help="default: TOOLKIT_ENGINE, else accelerate")
    p.add_argument("--num_processes", "--num-processes", type=int, help="override the profile (all machines)")
    p.add_argument("--machine_rank", "--machine-rank", type=int, help="this machine's rank (multi-node)")
    p.add_argument("--main_process_port", "--main-process-port", type=int, help="override the profile's port")
    p.add_argument("--max_restarts", "--max-restarts", type=int, default=0,
                   help="restart the worker group this many times after a failure (the script resumes)")
    p.add_argument("--dry-run", "--dry_run", action="store_true", help="print the command and environment only")
    p.add_argument("script", nargs=argparse.REMAINDER, help="script.py [args ...]")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other user error here
        self.exit(2, f"error: {message} (see `toolkit --help`)\n")


def main(argv=None) -> int:
    parser = _Parser(prog="toolkit", description=__doc__.strip().splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _launch_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "launch":
            from toolkit.launcher import launch

            return launch(args)
    except UserError as error:
        return report(error)
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
