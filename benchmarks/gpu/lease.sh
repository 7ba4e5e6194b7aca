#!/usr/bin/env bash
# The GPU checks of bench/tune (part 1), memory and serving (part 2), cut to fit one 15-minute lease of
# an H200: two calls back to back on one warm machine, each under its own deadline in seconds. The
# full-length checks are bench.sh, memory.sh and serve.sh; this one runs fewer steps, rounds and
# servers, and leaves out frameworks.py and tune on digits.
#   PART=1 DEADLINE=450 OUT=/some/dir bash benchmarks/gpu/lease.sh
#   PART=2 DEADLINE=300 OUT=/some/dir bash benchmarks/gpu/lease.sh     (serving wants .whl/, see serve.sh)
# On 2026-12-04 part 1 took 236 s (before tune on digits joined it, and with a 40 s tune of GPT-2) and part 2
# 285 s; the machine's start took about a minute. Set part 2's deadline from the lease's time left.
#   DEVICE=cpu QUICK=1 PART=1 OUT=/tmp/x PYTHON=.venv/bin/python bash benchmarks/gpu/lease.sh   # a dry run
# Part 3 (added when CUDA graphs for training joined auto, tune and profile): the issue's goals first, part 1's digits
#   checks and its tune of GPT-2 small at batch 64 with the tuned run (MFU); then tests/gpu; then, as the deadline
#   leaves time, a profile of digits under CUDA graphs, tune on digits, each attention kernel against torch's pick
#   on GPT-2 small's shape (attention_speed.py), and frameworks.py on digits. Its first five steps' limits add up to
#   520 s: run it as `PART=3 DEADLINE=530`, the device call's timeout_s about 590.
# Part 1: doctor; bench on digits; naive vs auto for 2,000 steps end to end; GPT-2-small for 300 steps
#   under the Trainer (summary vs logged step speed, compile count); tune on digits (CUDA graphs among
#   the candidates) and its tuned run; tune GPT-2-small at batch 64, then its tuned run (MFU).
# Part 2: memory estimate vs torch.cuda.max_memory_allocated; find_batch_size and out-of-memory recovery
#   under a 24 GiB cap; tests/gpu; then, with the time left, the InferenceEngine's settings and `redline
#   serve` eager fp32 vs bf16 + compile + CUDA graphs.
# Every step writes under $WORK; after each, $WORK is packed into $OUT/partN.tgz (what comes back holds
# at most 8 files), so a step cut short by the deadline loses only itself.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?OUT names the folder the results are packed into}
PART=${PART:?PART is 1 or 2}
DEADLINE=${DEADLINE:-400}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
WORK=${WORK:-/tmp/lease-part$PART}
rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
SITE=""
if [ "$PART" = 2 ] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi
export PYTHONPATH="$PWD/src${SITE:+:$SITE}" PYTHONUNBUFFERED=1 COLUMNS=160
export REDLINE_CACHE_DIR="$WORK/cache" REDLINE_RESULTS="$WORK"
START=$SECONDS

keep() { cp "$WORK/$1.out" "$WORK/$2" 2>/dev/null || true; }  # keep NAME FILE: a step's output under the name read later
pack() {  # weights and optimizer state stay behind: GPT-2 small's run writes gigabytes of them
  # packed beside, then moved: a pack cut short by the call's own timeout leaves the last whole archive
  tar czf "$OUT/part$PART.tgz.tmp" --exclude='*.safetensors' --exclude='*.pt' -C "$WORK" . 2>/dev/null \
    && mv -f "$OUT/part$PART.tgz.tmp" "$OUT/part$PART.tgz"
}
# step SECONDS NAME CMD...: CMD under the lesser of SECONDS and the time left; its output in $WORK/NAME.log
step() {
  local want=$1 name=$2 left=$((DEADLINE - (SECONDS - START)))
  shift 2
  local limit=$((want < left ? want : left))
  if [ "$limit" -lt 15 ]; then
    echo "$name: skipped, ${left} s left" | tee -a "$WORK/steps.txt"
    return 0
  fi
  echo "== $name (limit $limit s, $((SECONDS - START)) s so far)" | tee -a "$WORK/steps.txt"
  local began=$SECONDS
  # train and tune take SIGTERM as a clean stop (a checkpoint, the final evaluation): killed 15 s past the limit
  timeout -k 15 "$limit" "$@" > "$WORK/$name.out" 2> "$WORK/$name.log"
  echo "$name: exit $? after $((SECONDS - began)) s" | tee -a "$WORK/steps.txt"
  pack
}

FAST=redline-fast  # bf16 + compile + CUDA graphs; on a CPU (no CUDA graphs) auto stands in
[ "$DEVICE" = cpu ] && FAST=redline
if [ -n "${QUICK:-}" ]; then  # the CPU dry run: every command, a few steps each
  STEPS=10; LONG=40; GPT_STEPS=6; TUNED=6; GPT="--task example:chargpt --task-arg n_layer=2 --task-arg n_embd=64"
  GPT_BIG="$GPT"; MODELS=mlp,digits; SIZES=1,4; ROUNDS=1; DURATION=1
else
  STEPS=200; LONG=2000; GPT_STEPS=300; TUNED=40
  GPT="--task example:chargpt --task-arg n_layer=12 --task-arg n_head=12 --task-arg n_embd=768
       --task-arg block_size=1024 --task-arg batch_size=16 --task-arg epochs=1000 --task-arg lr=6e-4"
  GPT_BIG="${GPT/batch_size=16/batch_size=64}"; MODELS=mlp,digits,chargpt,gpt2; SIZES=1,4,32; ROUNDS=3; DURATION=4
fi

{ nvidia-smi; "$PY" -c "import sys, torch; print(sys.version); print(torch.__version__, torch.cuda.is_available())"; } \
  > "$WORK/machine.txt" 2>&1
if ! "$PY" -c "import redline.cli.main" 2> "$WORK/import.log"; then
  echo "redline does not import here:" && cat "$WORK/import.log" && pack && exit 3
fi

# The digits checks both part 1 and part 3 run: bench and naive vs auto end to end, then (tune) tune and its run.
bench_digits() {
  step 90 bench-digits "$PY" -m redline bench --task example:digits --devices "$DEVICE" --steps "$STEPS" \
    --planned-steps "$LONG" --json --html "$WORK/bench-digits.html"
  keep bench-digits bench-digits.json
  step 90 speedup-digits "$PY" benchmarks/speedup.py --device "$DEVICE" --tasks example:digits --steps "$LONG" \
    --repeats 2
  keep speedup-digits speedup-digits.txt
}
tune_digits() {
  step 60 tune-digits "$PY" -m redline tune --task example:digits --devices "$DEVICE" --budget 30 \
    --planned-steps "$LONG" --json
  keep tune-digits tune-digits.json
  step 40 tuned-digits "$PY" -m redline train --task example:digits --devices "$DEVICE" --plan tuned \
    --max-steps "$LONG" --no-progress --json
  keep tuned-digits tuned-digits.json
}

tune_gpt2() {  # tune GPT-2 small at batch 64, then its tuned run: the MFU goal
  step 120 tune-gpt2-b64 "$PY" -m redline tune $GPT_BIG --devices "$DEVICE" --budget 70 --planned-steps 5000 \
    --steps 10 --json
  keep tune-gpt2-b64 tune-gpt2-b64.json
  step 70 tuned-gpt2-b64 "$PY" -m redline train $GPT_BIG --devices "$DEVICE" --plan tuned --max-steps "$TUNED" \
    --no-progress --json
  keep tuned-gpt2-b64 tuned-gpt2-b64.json
}

if [ "$PART" = 3 ]; then  # the issue's goals first (digits vs naive, GPT-2's MFU), tests/gpu, then what time leaves
  bench_digits
  tune_gpt2
  if [ "$DEVICE" != cpu ]; then  # verbose, each test bounded: a step cut short still shows which test ran
    step 150 gpu-tests "$PY" -m pytest -v -p no:cacheprovider -rs --timeout 60 tests/gpu
  fi
  GRAPHS=on
  [ "$DEVICE" = cpu ] && GRAPHS=off
  step 40 profile-graphs "$PY" -m redline profile --task example:digits --devices "$DEVICE" --precision fp32 \
    --compile off --cuda-graphs "$GRAPHS" --steps 20
  tune_digits
  ATTENTION="example:chargpt?n_layer=12&n_head=12&n_embd=768&block_size=1024&batch_size=16"  # GPT-2 small's shape
  [ -n "${QUICK:-}" ] && ATTENTION="example:chargpt?n_layer=2&n_embd=64"
  step 70 attention "$PY" benchmarks/attention_speed.py --device "$DEVICE" --tasks "$ATTENTION" --rounds 3 \
    --block 3 --write "attention-$DEVICE"
  step 60 memory-math "$PY" benchmarks/memory_accuracy.py --device "$DEVICE" --models chargpt \
    --precisions bf16-mixed --attention math --write "memory-attention-$DEVICE"
  FW_STEPS=600
  [ -n "${QUICK:-}" ] && FW_STEPS=20
  step 200 frameworks "$PY" benchmarks/frameworks.py --device "$DEVICE" --rounds 1 --tasks example:digits \
    --steps "$FW_STEPS" --python "$PY" --timeout 60 --tune-budget 30 --write "frameworks-$DEVICE"
  cp benchmarks/results/frameworks-$DEVICE.md "$WORK/" 2>/dev/null
  pack
  "$PY" benchmarks/gpu/bench_summary.py "$WORK" > "$WORK/summary.md" 2>&1
elif [ "$PART" = 1 ]; then
  step 30 doctor "$PY" -m redline doctor --json
  bench_digits
  step 120 gpt2-small "$PY" -m redline train $GPT --devices "$DEVICE" --precision bf16-mixed --compile on \
    --max-steps "$GPT_STEPS" --log-every 25 --no-progress --json --out "$WORK/gpt2-run"
  keep gpt2-small gpt2-small.json
  tune_digits
  tune_gpt2
  "$PY" benchmarks/gpu/bench_summary.py "$WORK" > "$WORK/summary.md" 2>&1
else
  step 90 memory-accuracy "$PY" benchmarks/memory_accuracy.py --device "$DEVICE" --models "$MODELS" \
    --write "memory-$DEVICE"
  step 75 memory-fit "$PY" benchmarks/memory_fit.py --device "$DEVICE" --write "memory-fit-$DEVICE"
  if [ "$DEVICE" != cpu ]; then
    step 90 gpu-tests "$PY" -m pytest -q -p no:cacheprovider tests/gpu
  fi
  step 100 engine-speed "$PY" benchmarks/engine_speed.py --device "$DEVICE" --batch-sizes "$SIZES" \
    --rounds "$ROUNDS" --calls 30 --write "engine-$DEVICE"
  step 130 serve "$PY" benchmarks/serve.py --device "$DEVICE" --servers "redline-eager,$FAST" \
    --base redline-eager --duration "$DURATION" --write "serve-$DEVICE"
fi
pack
cat "$WORK/steps.txt"
[ -f "$WORK/summary.md" ] && cat "$WORK/summary.md"
exit 0
