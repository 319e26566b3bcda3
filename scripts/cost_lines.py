"""Print where a finished run's time and memory went, from its OUTPUT_DIR: the summary's split, peak memory, FLOPs
per sample and MFU, the median step's data and compute seconds, and the profiler's top ops with its traces.

    python scripts/cost_lines.py runs/resnet18
"""

import csv
import json
import statistics
import sys
from pathlib import Path

run = Path(sys.argv[1])
summary = json.loads((run / "summary.json").read_text())
split = summary["time_split_s"]
total = sum(split.values()) or 1.0
print("time split: " + " · ".join(f"{part} {seconds:.2f} s ({seconds / total:.0%})" for part, seconds in split.items()))
with open(run / "steps.csv") as f:
    rows = list(csv.DictReader(f))
rows = rows[summary["warmup_steps"]:] or rows  # past the warm-up, when the run went further
for column in ("data_s", "compute_s"):
    print(f"median step {column}: {statistics.median(float(row[column]) for row in rows) * 1e3:.2f} ms")
peak = summary["peak_memory_bytes"]
print(f"peak memory: {peak['min_rank'] / 2**30:.2f} to {peak['max_rank'] / 2**30:.2f} GiB over ranks")
mfu = summary["mfu"]
print(f"flops per sample: {summary['flops_per_sample']}, {summary['images_per_s']} images/s, "
      f"MFU {'unknown' if mfu is None else f'{mfu:.1%}'}")
print(f"time to first step: {summary['time_to_first_step_s']} s")
profile = run / "profile"
print("traces: " + ", ".join(sorted(p.name for p in profile.glob("*.json*"))))
print((profile / "top-ops.txt").read_text())
