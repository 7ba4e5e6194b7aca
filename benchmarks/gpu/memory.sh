#!/usr/bin/env bash
# GPU check for the memory estimate: predicted vs torch.cuda.max_memory_allocated for an MLP, digits,
# chargpt and transformers' GPT-2 (where installed) at GPT-2 small's shape, fp32 and bf16-mixed, two
# batch sizes each. Results go to $OUT (or benchmarks/results/). Under 8 minutes on an H200.
#   PYTHONPATH=src bash benchmarks/gpu/memory.sh            (DEVICE=cpu for a dry run here)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export REDLINE_RESULTS=${OUT:-benchmarks/results}
timeout 420 "$PYTHON" benchmarks/memory_accuracy.py --device "$DEVICE" --write "memory-$DEVICE"
