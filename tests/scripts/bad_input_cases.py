"""Run many bad-input cases of the CIFAR recipe inside one multi-process launch (tests/test_bad_input_launched.py).

    accelerate launch --config_file cpu.yaml tests/scripts/bad_input_cases.py CASES.json RESULTS_DIR

CASES.json is a list of {"name", "argv"}. Each case goes through the recipe's own `main` on every rank, as
under a launch of its own; its failure is said the way an uncaught one is (`toolkit.errors.say`: once per
job, or once per node before the process group exists) and recorded per rank in RESULTS_DIR/rank-R.json.
Between cases the ranks meet and the job's failure record is cleared, as a fresh launch would have it.
The last case is left uncaught: it ends the ranks for real (exit code, torchelastic's error file), so the
launcher's own exit and summary are checked too. One process start for the lot: a launch costs ~10 s here.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from toolkit import errors

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("cifar_recipe", ROOT / "recipes" / "cifar.py")
cifar = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cifar)


def run_case(argv) -> dict:
    """What this rank's run of the recipe ended with; said: whether this rank printed the sentence."""
    try:
        cifar.main(argv)
    except errors.RunFailure as error:
        return {"kind": type(error).__name__, "code": error.exit_code, "said": errors.say(error)}
    except SystemExit as exit_:  # argparse: it printed its line already (local rank 0 only)
        return {"kind": "SystemExit", "code": exit_.code, "said": os.environ.get("LOCAL_RANK", "0") == "0"}
    except BaseException as error:  # noqa: BLE001 - any other exception is what the test must catch
        return {"kind": type(error).__name__, "code": None, "said": False, "message": str(error)[:500]}
    return {"kind": "finished", "code": 0, "said": False}


def next_case():
    """Meet the other ranks and forget the last case's failure, as a fresh launch would."""
    if dist.is_initialized():
        dist.barrier()
        if dist.get_rank() == 0:
            store = dist.distributed_c10d._get_default_store()
            for suffix in ("/count", "/code", "/message"):
                store.delete_key(errors._failure_key() + suffix)
        dist.barrier()


def main():
    cases, results_dir = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = os.environ.get("RANK", "0")
    results = {}
    for case in cases[:-1]:
        results[case["name"]] = {**run_case(case["argv"]), "group_formed": dist.is_initialized()}
        sys.stderr.flush()
        next_case()
    (results_dir / f"rank-{rank}.json").write_text(json.dumps(results))
    cifar.main(cases[-1]["argv"])  # uncaught: the excepthook ends this rank as it ends any run
    print("not reached: the last case should have stopped every rank", flush=True)


if __name__ == "__main__":
    main()
