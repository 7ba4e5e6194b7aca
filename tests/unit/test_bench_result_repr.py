"""A BenchResult printed in a notebook is one line of its rows' figures, not every field of every row."""

from redline.bench.result import BenchResult, BenchRow


def test_a_bench_result_prints_each_rows_rate_and_speed_up_on_one_line():
    rows = (
        BenchRow(name="naive cpu fp32 b64", kind="naive", device="cpu", precision="fp32", compile=False,
                 channels_last=False, batch_size=64, samples_per_s=1234.5678, speedup_naive=1.0),
        BenchRow(name="auto cpu b64", kind="auto", device="cpu", precision="auto", compile=None, channels_last=None,
                 batch_size=64, samples_per_s=2049.0, speedup_naive=1.6598),
        BenchRow(name="cpu fp16-mixed eager b64", kind="explicit", device="cpu", precision="fp16-mixed", compile=False,
                 channels_last=False, batch_size=64, error="RuntimeError: no fp16 on a CPU"),
    )  # fmt: skip
    result = BenchResult(task="digits", steps=200, window=10, measured_at="now", machine={}, versions={}, rows=rows)
    assert repr(result) == (
        "BenchResult(task='digits', steps=200, rows={'naive cpu fp32 b64': 1235/s (1.00x naive), "
        "'auto cpu b64': 2049/s (1.66x naive), 'cpu fp16-mixed eager b64': failed})"
    )
    stopped = BenchResult(task="digits", steps=0, window=10, measured_at="now", machine={}, versions={}, rows=(),
                          interrupted="stopped by Ctrl-C at batch size 64")  # fmt: skip
    assert (
        repr(stopped)
        == "BenchResult(task='digits', steps=0, interrupted='stopped by Ctrl-C at batch size 64', rows={})"
    )
