#!/usr/bin/env bash
# GPU checks of the distributed path on a machine with one CUDA GPU; about 3 minutes on an H200.
#   OUT=/some/dir bash benchmarks/gpu/dist.sh
# The single-GPU NCCL path (redline launch --nproc 1: process group, DDP wrapper, rank-0 files) and
# FSDP2 on one GPU (fully_shard over a 1-rank NCCL mesh, bf16 MixedPrecisionPolicy, sharded
# checkpoints written through DCP) against the plain single-device run of the same task, steps
# timed by the Trainer ($OUT/dist-gpu.txt).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TASK="--task example:chargpt --task-arg n_layer=6 --task-arg n_embd=384 --task-arg n_head=6
      --task-arg block_size=256 --task-arg batch_size=64 --task-arg epochs=1000"
common="--precision bf16-mixed --compile off --max-steps 400 --log-every 100 --no-progress --json --seed 0"

timeout 200 "$PY" -m redline train $TASK $common > "$OUT/single.json" 2> "$OUT/single.log"
timeout 200 "$PY" -m redline train $TASK $common --nproc 1 --strategy ddp > "$OUT/nccl.json" 2> "$OUT/nccl.log"
rm -rf "$OUT/fsdp-run"
timeout 200 "$PY" -m redline train $TASK $common --nproc 1 --strategy fsdp --checkpoint-every 200 \
  --out "$OUT/fsdp-run" > "$OUT/fsdp.json" 2> "$OUT/fsdp.log"
"$PY" - "$OUT" <<'PY' | tee "$OUT/dist-gpu.txt"
import json, sys
single = json.load(open(f"{sys.argv[1]}/single.json"))
nccl = json.load(open(f"{sys.argv[1]}/nccl.json"))
print(f"single device: {single['tokens_per_s']:,.0f} tokens/s; strategy {single['plan']['strategy']['value']}")
print(f"launch --nproc 1 (NCCL, DDP): {nccl['tokens_per_s']:,.0f} tokens/s; strategy {nccl['plan']['strategy']['value']}")
print(f"step-time ratio (NCCL/DDP path over single): {single['tokens_per_s'] / nccl['tokens_per_s']:.3f}")
try:
    fsdp = json.load(open(f"{sys.argv[1]}/fsdp.json"))
except (OSError, ValueError) as exc:
    print(f"FSDP run failed ({exc}); see fsdp.log")
else:
    print(f"launch --nproc 1 (NCCL, FSDP2): {fsdp['tokens_per_s']:,.0f} tokens/s; strategy "
          f"{fsdp['plan']['strategy']['value']}; checkpoint {fsdp['checkpoint']}")
    print(f"step-time ratio (FSDP2 over single): {single['tokens_per_s'] / fsdp['tokens_per_s']:.3f}")
    print(f"final loss single {single['final_loss']:.4f}, DDP {nccl['final_loss']:.4f}, FSDP2 {fsdp['final_loss']:.4f}")
PY
