#!/usr/bin/env bash
# GPU checks of the Runtime, for a machine with one CUDA GPU; about 5 minutes on an H200.
# Runs redline from the source tree with the machine's own python3 and torch:
#   OUT=/some/dir bash benchmarks/gpu/runtime.sh
# Writes: $OUT/gpu-tests.log (bf16 parity with its tolerance, loader, auto Plan),
#         $OUT/runtime-plan.txt (what auto chose), $OUT/speedup-gpu.md (naive loop vs auto Plan).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 REDLINE_RESULTS="$OUT"
PY=${PYTHON:-python3}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu-tests.log"
timeout 240 "$PY" -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 | tee -a "$OUT/gpu-tests.log"
timeout 60 "$PY" - <<'PY' 2>&1 | tee "$OUT/runtime-plan.txt"
import torch, redline
for steps in (500, 5000):
    rt = redline.Runtime(planned_steps=steps)
    rt.setup(redline.load_task("example:digits").build_model(), lambda p: torch.optim.AdamW(p))
    print(f"planned_steps={steps}\n{rt.explain()}\n")
PY
timeout 300 "$PY" benchmarks/speedup.py --device cuda --steps 3000 --repeats 2 --write speedup-gpu 2>&1 \
  | tee "$OUT/speedup.log"
