"""benchmarks/gpu/bench_summary.py's bench table marks what the CLI marks: cached seconds, fp32 run in TF32."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "gpu"))

from bench_summary import bench_lines

from report_samples import _row


def test_cached_compiles_and_trials_and_fp32_rows_run_in_tf32_are_marked_and_footnoted(tmp_path):
    tf32 = {"tf32": {"value": True, "reason": "NVIDIA H100 has TF32 tensor cores"}}
    rows = [
        _row("naive cuda fp32 b64", "naive", 5000.0, device="cuda"),
        _row("cuda fp32 compiled b64", "explicit", 7000.0, device="cuda", compile=True, compile_s=0.25,
             compile_cached=True, plan=tf32),
        _row("auto cuda b64", "auto", 7000.0, device="cuda", compile=True, compile_s=0.25, compile_cached=True,
             trial_s=1.13, trial_cached=False, plan=tf32),
    ]  # fmt: skip
    (tmp_path / "bench-digits.json").write_text(json.dumps({"rows": rows}))
    text = "\n".join(bench_lines(tmp_path))
    assert "| cuda fp32 (TF32) compiled b64 |" in text and "| naive cuda fp32 b64 |" in text
    assert "| 0.2* | 1.1 |" in text and "| 0.2* |  |" in text
    assert "- `*` beside a compile's seconds: torch's on-disk compile caches" in text
    assert "- fp32 (TF32): the row's fp32 matmuls ran in TF32" in text and "trial's seconds" not in text
    rows[2]["trial_cached"] = True
    (tmp_path / "bench-digits.json").write_text(json.dumps({"rows": rows}))
    text = "\n".join(bench_lines(tmp_path))
    assert "| 0.2* | 1.1* |" in text and "- `*` beside a trial's seconds: redline's trial cache" in text
