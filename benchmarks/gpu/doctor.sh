#!/usr/bin/env bash
# `redline doctor` on a machine with a GPU; under a minute on an H200.
# Runs redline from the source tree with the machine's own python3 and torch:
#   OUT=/some/dir bash benchmarks/gpu/doctor.sh
# Writes: $OUT/doctor-h200.json (the report: every check must be ok, or explained in results/),
#         $OUT/doctor-h200-snapshot.json (the facts behind it: a fixture of a real GPU machine),
#         $OUT/doctor-h200-quick.json and doctor-h200-quick-snapshot.json (the same for --quick),
#         $OUT/doctor-h200.txt (the table a user sees, and how long each run of each mode took).
# Each mode runs twice, full first: the first full run pays for a cold page cache (torch's CUDA
# libraries), the second shows the warm figure; the goals are 15 s for the full run, 3 s for --quick.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-benchmarks/results/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1 COLUMNS=160
PY=${PYTHON:-python3}

# timed LABEL FILE COMMAND...: run COMMAND (120 s at most) with its stdout in FILE; print its exit code and wall ms.
timed() {
  local label=$1 file=$2 start code
  shift 2
  start=$(date +%s%N)
  timeout 120 "$@" > "$file"
  code=$?
  echo "$label: exit $code, $(( ($(date +%s%N) - start) / 1000000 )) ms"
}

{
  echo "# redline doctor on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC')"
  "$PY" -c 'import importlib.util as u; print("nvidia-ml-py:", "yes" if u.find_spec("pynvml") else "no (nvidia-smi fallback)")'
  timed "full run 1" "$OUT/doctor-h200.json" "$PY" -m redline doctor --json --save-probe "$OUT/doctor-h200-snapshot.json"
  timed "--quick run 1" "$OUT/doctor-h200-quick.json" \
    "$PY" -m redline doctor --quick --json --save-probe "$OUT/doctor-h200-quick-snapshot.json"
  timed "full run 2" /dev/null "$PY" -m redline doctor
  timed "--quick run 2" /dev/null "$PY" -m redline doctor --quick
  timeout 120 "$PY" -m redline doctor --probe-file "$OUT/doctor-h200-snapshot.json"
  timeout 120 "$PY" -m redline doctor --probe-file "$OUT/doctor-h200-quick-snapshot.json"
} 2>&1 | tee "$OUT/doctor-h200.txt"
