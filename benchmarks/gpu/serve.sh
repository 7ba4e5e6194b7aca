#!/usr/bin/env bash
# GPU check for serving, on one CUDA GPU; about 7 minutes on an H200.
# 1. engine_speed.py: the InferenceEngine without HTTP on the digits CNN and the 4096-wide MLP,
#    eager fp32 against CUDA graphs (fp32, bf16 autocast, bf16 weights, bf16 weights in channels_last for
#    the CNN), bf16 + compile + CUDA graphs, and auto (which times these itself), at batch 1, 4 and 32:
#    ms per call, samples/s, ratio to eager fp32, output difference, warm-up time.
# 2. serve.py: `redline serve` of both models with eager fp32 (redline-eager), bf16 + compile +
#    CUDA graphs (redline-fast) and auto (redline), closed loop at 64 and open loop: requests/s, p99.
# The GPU image lacks starlette, uvicorn, orjson and httptools: carry them as wheels in .whl/
# (../.library/device/README.md says how) and they are installed to /tmp/site first.
#   OUT=/some/dir bash benchmarks/gpu/serve.sh
#   DEVICE=cpu OUT=/tmp/x PYTHON=.venv/bin/python bash benchmarks/gpu/serve.sh    # a dry run on a CPU
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SITE=""
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && SITE=/tmp/site
fi
export PYTHONPATH="$PWD/src${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export REDLINE_RESULTS="$OUT" REDLINE_CACHE_DIR="$OUT/cache"
if [ "$DEVICE" = cpu ]; then SERVERS=redline-eager,redline; ROUNDS=2; DURATION=3; else SERVERS=redline-eager,redline-fast,redline; ROUNDS=7; DURATION=8; fi
START=$SECONDS
timeout 200 "$PY" benchmarks/engine_speed.py --device "$DEVICE" --rounds "$ROUNDS" --write "engine-$DEVICE" \
    2>&1 | tee "$OUT/engine_speed.log" | tail -40
echo "engine_speed: exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"
timeout 270 "$PY" benchmarks/serve.py --device "$DEVICE" --servers "$SERVERS" --base redline-eager \
    --duration "$DURATION" --write "serve-$DEVICE" 2>&1 | tee "$OUT/serve.log" | tail -20
echo "serve: exit ${PIPESTATUS[0]} after $((SECONDS - START)) s"
