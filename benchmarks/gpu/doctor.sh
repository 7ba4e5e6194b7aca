#!/usr/bin/env bash
# `redline doctor` on a machine with a GPU; under a minute on an H200.
# Runs redline from the source tree with the machine's own python3 and torch:
#   OUT=/some/dir bash benchmarks/gpu/doctor.sh
# Writes: $OUT/doctor-h200.json (the report: every check must be ok, or explained in results/),
#         $OUT/doctor-h200-snapshot.json (the facts behind it: a fixture of a real GPU machine),
#         $OUT/doctor-h200.txt (the table a user sees, the --quick table, and how long each run took).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
PY=${PYTHON:-python3}

{
  echo "# redline doctor on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC')"
  "$PY" -c 'import importlib.util as u; print("nvidia-ml-py:", "yes" if u.find_spec("pynvml") else "no (nvidia-smi fallback)")'
  start=$(date +%s%N)
  timeout 120 "$PY" -m redline doctor --json --save-probe "$OUT/doctor-h200-snapshot.json" > "$OUT/doctor-h200.json"
  echo "full run: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms"
  timeout 120 "$PY" -m redline doctor --probe-file "$OUT/doctor-h200-snapshot.json"
  start=$(date +%s%N)
  timeout 120 "$PY" -m redline doctor --quick > /dev/null
  echo "--quick run: exit $?, $(( ($(date +%s%N) - start) / 1000000 )) ms"
} 2>&1 | tee "$OUT/doctor-h200.txt"
