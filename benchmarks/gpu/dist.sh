#!/usr/bin/env bash
# GPU checks of the distributed path on a machine with one CUDA GPU; about 3 minutes on an H200.
#   OUT=/some/dir bash benchmarks/gpu/dist.sh
# Tried on a CPU in small: TASK="--task example:chargpt --devices cpu" MAX_STEPS=120 PYTHON=.venv/bin/python
# The single-GPU NCCL path (redline launch --nproc 1: process group, DDP wrapper, rank-0 files) and
# FSDP2 on one GPU (fully_shard over a 1-rank NCCL mesh, bf16 MixedPrecisionPolicy, sharded
# checkpoints written through DCP) against the plain single-device run of the same task, steps
# timed by the Trainer: the median logged step time after step 100 (steady state) and the whole
# run's tokens/s ($OUT/dist-gpu.txt). Goals: DDP within 1.02x and FSDP2 within 1.3x of single.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
TASK=${TASK:-"--task example:chargpt --task-arg n_layer=6 --task-arg n_embd=384 --task-arg n_head=6
      --task-arg block_size=256 --task-arg batch_size=64 --task-arg epochs=1000"}
common="--precision bf16-mixed --compile off --max-steps ${MAX_STEPS:-400} --log-every 50 --no-progress --json --seed 0"

for run in single nccl fsdp; do rm -rf "$OUT/$run-run"; done
timeout 200 "$PY" -m redline train $TASK $common --out "$OUT/single-run" > "$OUT/single.json" 2> "$OUT/single.log"
timeout 200 "$PY" -m redline train $TASK $common --nproc 1 --strategy ddp --out "$OUT/nccl-run" \
  > "$OUT/nccl.json" 2> "$OUT/nccl.log"
timeout 200 "$PY" -m redline train $TASK $common --nproc 1 --strategy fsdp --checkpoint-every 200 \
  --out "$OUT/fsdp-run" > "$OUT/fsdp.json" 2> "$OUT/fsdp.log"
"$PY" - "$OUT" <<'PY' | tee "$OUT/dist-gpu.txt"
import json, statistics, sys
out = sys.argv[1]


def steady_ms(run):
    """Median step time of the logged windows after step 100: warm-up and one-time set-up excluded."""
    rows = [json.loads(line) for line in open(f"{out}/{run}-run/metrics.jsonl")]
    steady = [r["step_time_ms"] for r in rows if r["step"] > min(100, rows[-1]["step"] // 2) and r["step_time_ms"]]
    return statistics.median(steady)


results = {}
for run, label in (("single", "single device"), ("nccl", "launch --nproc 1, DDP (NCCL)"),
                   ("fsdp", "launch --nproc 1, FSDP2 (NCCL)")):
    try:
        summary = json.load(open(f"{out}/{run}.json"))
        results[run] = (summary, steady_ms(run))
    except (OSError, ValueError, KeyError) as exc:
        print(f"{label}: failed ({exc}); see {run}.log")
        continue
    summary, ms = results[run]
    print(f"{label}: {summary['tokens_per_s']:,.0f} tokens/s over the run, steady step {ms:.2f} ms; "
          f"strategy {summary['plan']['strategy']['value']} ({summary['plan']['strategy']['reason']}); "
          f"final loss {summary['final_loss']:.4f}")
if "single" in results:
    for run in ("nccl", "fsdp"):
        if run in results:
            print(f"steady step-time ratio {run} / single: {results[run][1] / results['single'][1]:.3f}; over the run "
                  f"{results['single'][0]['tokens_per_s'] / results[run][0]['tokens_per_s']:.3f}")
PY
