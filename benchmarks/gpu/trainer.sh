#!/usr/bin/env bash
# GPU checks of the Trainer on one CUDA GPU; about 6 minutes on an H200.
#   OUT=/some/dir bash benchmarks/gpu/trainer.sh
# 1. chargpt scaled to GPT-2 small's shape (12 layers, 12 heads, 768 wide, context 1024) in bf16
#    with compile: tokens/s and MFU from the summary ($OUT/gpt2-small.json; goal MFU >= 55%).
# 2. Resume on the GPU: 40 steps unbroken vs 20 + resume + 20 under --deterministic; the largest
#    weight difference is printed against the stated tolerance ($OUT/resume-gpu.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
GPT2="--task example:chargpt --task-arg n_layer=12 --task-arg n_head=12 --task-arg n_embd=768
      --task-arg block_size=1024 --task-arg batch_size=16 --task-arg epochs=1000 --task-arg lr=6e-4"

timeout 420 "$PY" -m redline train $GPT2 --precision bf16-mixed --compile on --max-steps 300 \
  --log-every 50 --no-progress --json --out "$OUT/gpt2-run" > "$OUT/gpt2-small.json" 2> "$OUT/gpt2-small.log"
"$PY" - "$OUT/gpt2-small.json" <<'PY' | tee "$OUT/gpt2-small.txt"
import json, sys
s = json.load(open(sys.argv[1]))
print(f"tokens/s {s['tokens_per_s']:,.0f}  MFU {s['mfu']}  peak {s['mfu_peak_tflops']} TFLOP/s  "
      f"of measured matmul {s['measured_peak_ratio']}  compile {s['compile_seconds']} s  steps {s['steps']}")
PY

SMALL="--task example:chargpt --task-arg n_layer=4 --task-arg n_embd=256 --task-arg epochs=1000"
common="--precision bf16-mixed --compile off --deterministic --seed 0 --no-progress --checkpoint-every 10"
rm -rf "$OUT/r-full" "$OUT/r-half"
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 "$PY" -m redline train $SMALL $common --max-steps 40 --out "$OUT/r-full" > /dev/null
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 "$PY" -m redline train $SMALL $common --max-steps 20 --out "$OUT/r-half" > /dev/null
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 "$PY" -m redline train $SMALL $common --max-steps 40 --out "$OUT/r-half" --resume auto > /dev/null
"$PY" - "$OUT" <<'PY' | tee "$OUT/resume-gpu.txt"
import sys
from safetensors.torch import load_file
a = load_file(f"{sys.argv[1]}/r-full/model.safetensors")
b = load_file(f"{sys.argv[1]}/r-half/model.safetensors")
worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
print(f"resume on GPU: max abs weight difference {worst:.3g} (tolerance 1e-6 under --deterministic): "
      f"{'ok' if worst <= 1e-6 else 'FAIL'}")
PY
