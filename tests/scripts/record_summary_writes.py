"""Run a script as `__main__` and append one line per write of a file named summary.json to
$SUMMARY_WRITES_LOG, so a test can count how many processes wrote the run summary.

    SUMMARY_WRITES_LOG=writes.txt torchrun --nproc_per_node 2 tests/scripts/record_summary_writes.py \
        recipes/cifar.py --dataset synthetic ...

With $RECORD_WRITES_UNDER set to a folder, every write of a file under it is logged too, with its path.

A Python audit hook sees every open() and os.rename/os.replace in the process, whichever library makes
them, so a rank that wrote the summary directly or through a temporary file is counted either way.
"""

import os
import runpy
import sys

LOG = os.environ["SUMMARY_WRITES_LOG"]
UNDER = os.path.abspath(os.environ["RECORD_WRITES_UNDER"]) + os.sep if os.environ.get("RECORD_WRITES_UNDER") else None


def writes(event, args) -> bool:
    if event == "os.rename":  # os.rename and os.replace
        return True
    if event != "open":
        return False
    mode, flags = args[1], args[2]
    if mode is None:  # os.open(path, flags)
        return bool(flags & (os.O_WRONLY | os.O_RDWR))
    return isinstance(mode, str) and bool(set(mode) & set("wax+"))  # open(path, mode)


def record(event, args):
    if not writes(event, args):
        return
    target = args[1] if event == "os.rename" else args[0]
    if not isinstance(target, (str, bytes, os.PathLike)):
        return
    path = os.path.abspath(os.fsdecode(target))
    if os.path.basename(path) == "summary.json":
        with open(LOG, "a") as log:  # this open is audited too, but is not a summary.json
            log.write(f"{os.getpid()} rank={os.environ.get('RANK', '0')} {event}\n")
    elif UNDER and path.startswith(UNDER):
        with open(LOG + ".all", "a") as log:
            log.write(f"rank={os.environ.get('RANK', '0')} {event} {path}\n")


sys.addaudithook(record)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
