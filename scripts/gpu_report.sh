#!/usr/bin/env bash
# One command on a GPU machine (at most ~8 minutes on one GPU): the gpu-marked tests, then the GPU benchmarks,
# into one markdown report (versions, GPU, each test's result, images/s tables).
#
#     scripts/gpu_report.sh [REPORT.md]        # default benchmarks/out/gpu_report.md
#
# Targets for one H200 (record the figures in benchmarks/README.md only from a run of this script):
#   - resnet9 training >= 50,000 images/s with bf16 + channels_last + compile (model_throughput.py);
#     airbench94's 2M-parameter net trains at roughly 160,000 images/s on an A100.
#   - memory loader >= 100x the DataLoader + PIL pipeline (data_loading.py --device cuda).
#   - resnet18 bf16 (recipes/cifar.py): where a step's time goes (data / compute from CUDA events / checkpoint),
#     peak memory and MFU against the H200's 989 TFLOP/s, and a profiler trace of steps 60-65 with its top ops.
# Without CUDA it refuses in one sentence and exits 2; GPU_REPORT_DRY_RUN=1 prints the steps it would run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPORT=${1:-benchmarks/out/gpu_report.md}
OUT=$(dirname "$REPORT")/gpu_report_parts
STEPS=(
  "timeout 240 python -m pytest -m gpu -rA -q tests/test_gpu.py --junitxml=$OUT/tests.xml"
  "timeout 180 python benchmarks/model_throughput.py --device cuda --models resnet9,resnet18 --budget-s 150 --out $OUT/model_throughput"
  "timeout 45 python benchmarks/data_loading.py --device cuda --out $OUT/data_loading"
  "timeout 150 python recipes/cifar.py --dataset synthetic --model resnet18 --mixed-precision bf16 --epochs 1 --max-steps 80 --profile-steps 60:65 --output-dir $OUT/resnet18 && python scripts/cost_lines.py $OUT/resnet18"
)
if [[ "${GPU_REPORT_DRY_RUN:-0}" == 1 ]]; then printf '%s\n' "${STEPS[@]}"; exit 0; fi
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_report.sh: no CUDA device is visible here; run it on a GPU machine." >&2
  exit 2
fi
mkdir -p "$OUT"
status=0
{
  echo "# GPU report ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown))"
  echo
  python - <<'PY'
import torch, accelerate, platform
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuDNN {torch.backends.cudnn.version()}, accelerate {accelerate.__version__}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"- GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
PY
} > "$REPORT"
for step in "${STEPS[@]}"; do
  echo; echo "\$ $step" >&2
  { echo; echo "## \`${step%% --out*}\`"; echo; echo '```'; } >> "$REPORT"
  if ! eval "$step" > "$OUT/last.log" 2>&1; then status=1; fi
  tail -n 60 "$OUT/last.log" >> "$REPORT"; echo '```' >> "$REPORT"
done
for part in "$OUT"/*/results.md; do [[ -f "$part" ]] && { echo; cat "$part"; } >> "$REPORT"; done
echo "report: $REPORT" >&2
exit $status
