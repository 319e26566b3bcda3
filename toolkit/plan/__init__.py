"""Before a run: each setup's per-rank peak memory and step time, predicted on fake tensors, and the fastest that
fits (`toolkit plan`); in a run, its own forecast (`plan_run`: --micro-batch-size auto, and the check after the
first evaluation).

    trace.py      one training step on fake tensors: memory by kind (torch's MemTracker), FLOPs, bytes, ops
    memory.py     a rank's peak under an engine or mesh, in parts
    step_time.py  a step's compute, communication, bubble and data
    device.py     this machine (measured, cached), a GPU from its datasheet, or given figures
    table.py      the candidates, predicted, and the recommendation
    workloads.py  what each recipe trains
    forecast.py   a run's own plan
    command.py    `toolkit plan`
"""

from toolkit.plan import workloads
from toolkit.plan.forecast import Forecast, plan_run
from toolkit.plan.memory import Setup
from toolkit.plan.trace import Workload

__all__ = ["Forecast", "Setup", "Workload", "plan_run", "workloads"]
