"""The third way to launch, beside torchrun and `accelerate launch`: torch.multiprocessing from a plain script
or a notebook. Each worker gets the launch environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT) plus TOOLKIT_LAUNCHER=spawn, so `build_accelerator()` inside it forms the group as usual.

    import toolkit

    def train(lr):
        accelerator = toolkit.build_accelerator()     # ddp engine, rank 0 or 1 of 2
        ...

    toolkit.spawn(train, 2, 0.1)                      # returns when both workers have finished
"""

from __future__ import annotations

import os
import sys

from toolkit.errors import RunFailure, UserError, install_excepthook


def _worker(index: int, fn, num_processes: int, port: int, forked: bool, args: tuple):
    # Runs in the child: the parent's environment is untouched.
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(num_processes),
                      LOCAL_WORLD_SIZE=str(num_processes), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TOOLKIT_LAUNCHER="spawn")
    if forked or num_processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        import torch

        # One thread per worker, as torchrun gives each of several workers. A forked worker must: the OpenMP
        # pool its parent (a notebook that already ran a matmul) started does not survive the fork, and the
        # worker's first parallel op would wait for it forever.
        torch.set_num_threads(1)
    fn(*args)


def _default_start_method() -> str:
    # A function defined in a notebook cell cannot be pickled for "spawn"; fork copies it (as Accelerate's
    # notebook_launcher does). A script's functions are importable, and "spawn" avoids forking live threads.
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return "spawn" if main_file and os.path.isfile(main_file) else "fork"  # `python -c`, `python - < x`: fork


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), text)


def spawn(fn, num_processes: int, *args, start_method: str | None = None):
    """Run `fn(*args)` in `num_processes` worker processes on this machine and wait for all of them.

    A worker that raises becomes one sentence naming its rank and error (RunFailure, exit 1 from a script);
    the others are stopped.
    """
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from toolkit.launch.launcher import free_port

    install_excepthook()  # a script that calls spawn gets the one sentence, not a traceback
    if num_processes < 1:
        raise UserError(f"toolkit.spawn needs at least 1 process, not {num_processes}.")
    try:
        method = start_method or _default_start_method()
        mp.start_processes(_worker, args=(fn, num_processes, free_port(), method == "fork", args),
                           nprocs=num_processes, start_method=method)
    except ProcessRaisedException as error:
        # torch hands back the worker's whole traceback; its last line is the error itself.
        raise RunFailure(f"toolkit.spawn: rank {error.error_index} failed: {_last_line(str(error))}") from None
    except ProcessExitedException as error:
        raise RunFailure(f"toolkit.spawn: rank {error.error_index} exited with code {error.exit_code} "
                         "before finishing (killed, or it called sys.exit).") from None
