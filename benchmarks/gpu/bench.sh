#!/usr/bin/env bash
# The GPU checks of bench, tune and honest throughput, on one CUDA GPU; about 7.5 minutes on an H200.
#   OUT=/some/dir bash benchmarks/gpu/bench.sh
#   DEVICE=cpu QUICK=1 OUT=/tmp/x bash benchmarks/gpu/bench.sh    # a dry run of every step on a CPU
# 1. redline bench on digits: naive vs fp32/bf16 x eager/compiled vs auto (goal: auto >= 2x naive at
#    steady state), and a 2,000-step naive vs auto run end to end (goal >= 1.5x) by speedup.py.
# 2. redline tune on digits for 2,000 steps (CUDA graphs among the candidates), then the tuned run.
# 3. GPT-2-small chargpt, 300 steps under the Trainer: the summary's tokens/s against the logged
#    windows' median (goal: within 10%), and the compile count (goal: 1 training compile).
# 4. redline tune on GPT-2-small at batch 64, then 60 tuned steps: MFU (goal >= 50%).
# 5. benchmarks/frameworks.py when time is left and the peers import.
# Each step has its own timeout, so one that hangs costs its share only; results land in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
# Caches start empty in every run (the trials, tunes and compiles of this run only; step 2's tuned run reads step
# 2's tune): $OUT persists, and a cache kept there gave the next run's auto row the last run's tuned Plan.
CACHE=$(mktemp -d "${TMPDIR:-/tmp}/redline-bench-XXXXXX")
trap 'rm -rf "$CACHE"' EXIT
export PYTHONPATH=src PYTHONUNBUFFERED=1 REDLINE_CACHE_DIR="$CACHE/redline" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
START=$SECONDS
if [ -n "${QUICK:-}" ]; then  # the CPU dry run: every command, a few steps each
  STEPS=10; LONG=40; GPT_STEPS=6; TUNE=20; GPT="--task example:chargpt --task-arg n_layer=2 --task-arg n_embd=64"
  GPT_BIG="$GPT"
else
  STEPS=200; LONG=2000; GPT_STEPS=300; TUNE=60
  GPT="--task example:chargpt --task-arg n_layer=12 --task-arg n_head=12 --task-arg n_embd=768
       --task-arg block_size=1024 --task-arg batch_size=16 --task-arg epochs=1000 --task-arg lr=6e-4"
  GPT_BIG="${GPT/batch_size=16/batch_size=64}"
fi
step() { echo "== $1 ($((SECONDS - START)) s so far)" | tee -a "$OUT/steps.txt"; }

step "1a bench digits"
timeout 100 "$PY" -m redline bench --task example:digits --devices "$DEVICE" --steps "$STEPS" \
  --planned-steps "$LONG" --json --html "$OUT/bench-digits.html" > "$OUT/bench-digits.json" 2> "$OUT/bench-digits.log"
step "1b naive vs auto end to end, $LONG steps"
timeout 90 "$PY" benchmarks/speedup.py --device "$DEVICE" --tasks example:digits --steps "$LONG" --repeats 2 \
  > "$OUT/speedup-digits.txt" 2>&1

step "2 tune digits, then the tuned run"
timeout 75 "$PY" -m redline tune --task example:digits --devices "$DEVICE" --budget "$TUNE" --planned-steps "$LONG" \
  --json > "$OUT/tune-digits.json" 2> "$OUT/tune-digits.log"
timeout 60 "$PY" -m redline train --task example:digits --devices "$DEVICE" --plan tuned --max-steps "$LONG" \
  --no-progress --json > "$OUT/tuned-digits.json" 2> "$OUT/tuned-digits.log"

step "3 GPT-2-small, $GPT_STEPS steps under the Trainer"
timeout 150 "$PY" -m redline train $GPT --devices "$DEVICE" --precision bf16-mixed --compile on \
  --max-steps "$GPT_STEPS" --log-every 25 --no-progress --json --out "$OUT/gpt2-run" \
  > "$OUT/gpt2-small.json" 2> "$OUT/gpt2-small.log"

step "4 tune GPT-2-small at batch 64, then 60 tuned steps"
timeout 130 "$PY" -m redline tune $GPT_BIG --devices "$DEVICE" --budget "$((TUNE * 2))" --planned-steps 5000 \
  --steps 10 --json > "$OUT/tune-gpt2-b64.json" 2> "$OUT/tune-gpt2-b64.log"
timeout 90 "$PY" -m redline train $GPT_BIG --devices "$DEVICE" --plan tuned --max-steps "$((GPT_STEPS < 60 ? GPT_STEPS : 60))" \
  --no-progress --json > "$OUT/tuned-gpt2-b64.json" 2> "$OUT/tuned-gpt2-b64.log"

if [ $((SECONDS - START)) -lt 360 ]; then
  step "5 frameworks (peers where installed)"
  timeout $((450 - (SECONDS - START))) "$PY" benchmarks/frameworks.py --device "$DEVICE" --rounds 1 \
    --tasks example:digits > "$OUT/frameworks.txt" 2>&1
fi

step "summary"
"$PY" benchmarks/gpu/bench_summary.py "$OUT" | tee "$OUT/summary.md"
