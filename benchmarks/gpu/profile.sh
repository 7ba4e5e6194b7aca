#!/usr/bin/env bash
# `redline profile` on one CUDA GPU; about a minute and a half on an H200.
#   OUT=/some/dir bash benchmarks/gpu/profile.sh
#   DEVICE=cpu QUICK=1 OUT=/tmp/x bash benchmarks/gpu/profile.sh    # a dry run of every step on a CPU
# 1. digits (bound by kernel launches on a GPU), eager fp32: the GPU-busy share should be low and the
#    advice should name the idle GPU; then the same under compile with CUDA graphs, for comparison.
# 2. GPT-2-small chargpt at batch 16, bf16 eager: kernels attributed to forward, backward and optimizer
#    (goal: "other" holds under 5% of the GPU time), GPU busy above 90%.
# Each writes the profile as JSON and its trace (.json.gz) into $OUT; profile.txt holds the tables.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 REDLINE_CACHE_DIR="$OUT/cache" COLUMNS=160
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
if [ -n "${QUICK:-}" ]; then
  GPT="--task example:chargpt --task-arg n_layer=2 --task-arg n_embd=64"
else
  GPT="--task example:chargpt --task-arg n_layer=12 --task-arg n_head=12 --task-arg n_embd=768
       --task-arg block_size=1024 --task-arg batch_size=16"
fi
run() {  # run NAME ARGS...: the profile as JSON, its trace, and the tables a user sees
  local name=$1
  shift
  echo "== $name" | tee -a "$OUT/profile.txt"
  timeout 120 "$PY" -m redline profile "$@" --devices "$DEVICE" --json --trace "$OUT/trace-$name.json.gz" \
    > "$OUT/profile-$name.json" 2> "$OUT/profile-$name.log"
  echo "exit $?" >> "$OUT/profile.txt"
  timeout 120 "$PY" -m redline profile "$@" --devices "$DEVICE" >> "$OUT/profile.txt" 2>&1
}
run digits-eager --task example:digits --precision fp32 --compile off --steps 20
run digits-graphs --task example:digits --precision fp32 --compile on --compile-mode reduce-overhead --steps 20
run gpt2-bf16 $GPT --precision bf16-mixed --compile off --steps 10 --warmup 3
"$PY" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("profile-*.json")):
    try:
        data = json.loads(path.read_text())
    except ValueError:
        print(f"{path.name}: no profile (see its .log)")
        continue
    b = data["breakdown"]
    phases = ", ".join(f"{p['name']} {p['host_ms']:.3f}/{p['device_ms'] if p['device_ms'] is None else round(p['device_ms'], 3)}" for p in b["phases"])
    print(f"{path.name}: {b['steps']} steps of {b['step_ms']:.3f} ms; busy {b['device_busy']}; host/GPU ms: {phases}")
    print("  advice:", *data["advice"], sep="\n    ")
PY
