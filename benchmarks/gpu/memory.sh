#!/usr/bin/env bash
# GPU check for memory: (1) the estimate, predicted vs torch.cuda.max_memory_allocated for an MLP,
# digits, chargpt and transformers' GPT-2 (where installed) at GPT-2 small's shape, fp32 and
# bf16-mixed, two batch sizes each; (2) with the allocator capped at 24 GiB, the largest batch
# predicted, the one find_batch_size finds, and out-of-memory recovery at twice it (memory_fit.py).
# Results go to $OUT (or benchmarks/results/). Under 8 minutes on an H200.
#   PYTHONPATH=src bash benchmarks/gpu/memory.sh            (DEVICE=cpu for a dry run here)
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
export REDLINE_RESULTS=${OUT:-benchmarks/results}
timeout 240 "$PYTHON" benchmarks/memory_accuracy.py --device "$DEVICE" --write "memory-$DEVICE" || echo "accuracy: exit $?"
timeout 200 "$PYTHON" benchmarks/memory_fit.py --device "$DEVICE" --write "memory-fit-$DEVICE"
