"""The bench's terminal table and its best line, on a result given as data."""

from rich.console import Console

from redline.render.bench import bench_table, best_line
from redline.render.console import output_console, print_uncut
from redline.render.memory import size
from report_samples import _row


def shown(result) -> str:
    console = Console(width=300, record=True)
    console.print(bench_table(result))
    return console.export_text()


def result_of(*rows) -> dict:
    return {"task": "t", "steps": 10, "window": 5, "rows": [{"loss": 1.0, **row} for row in rows]}


def test_a_compile_without_an_eager_row_to_compare_is_not_called_never_repaid():
    compiled = _row("cpu fp32 compiled b64", "explicit", 6000.0, compile=True, compile_s=12.0)
    alone = shown(result_of(_row("naive cpu fp32 b64", "naive", 5000.0), compiled))
    assert " 12/- " in alone and "/never" not in alone and "-: no eager row to compare" in alone
    eager = _row("cpu fp32 eager b64", "explicit", 6500.0)  # faster than the compiled row: it never repays
    beside = shown(result_of(_row("naive cpu fp32 b64", "naive", 5000.0), eager, compiled))
    assert " 12/never " in beside
    repaid = dict(compiled, break_even_steps=1234.0)
    assert " 12/1,234 " in shown(result_of(eager, repaid))
    # 11.17 steps' saving repays it: the 12th, not the 11th (after 11 steps 0.200 s of 0.2035 s are saved)
    assert " 12/12 " in shown(result_of(eager, dict(compiled, break_even_steps=11.17)))


def test_a_compile_torchs_on_disk_caches_served_is_marked_and_said_under_the_table():
    eager = _row("cpu fp32 eager b64", "explicit", 6500.0)
    warm = _row("cpu fp32 compiled b64", "explicit", 7000.0, compile=True, compile_s=0.25, break_even_steps=10.0)
    text = " ".join(shown(result_of(eager, dict(warm, compile_cached=True))).split())
    assert " 0.2*/10 " in text and "TORCHINDUCTOR_CACHE_DIR set to a new empty folder" in text
    for cold in (False, None):  # every lookup missed, or torch did not say: no mark, no note
        text = " ".join(shown(result_of(eager, dict(warm, compile_cached=cold))).split())
        assert " 0.2/10 " in text and "*" not in text


def test_in_an_80_column_terminal_each_compile_cell_stays_on_its_row():
    # It read "12.0 s," / "repaid" / "in" / "1,234" / "steps", five lines down one narrow column.
    rows = [
        _row("naive cpu fp32 b64", "naive", 5000.0),
        _row("cpu fp32 eager b64", "explicit", 6500.0),
        _row("cpu fp32 compiled b64", "explicit", 7000.0, compile=True, compile_s=12.0, break_even_steps=1234.0),
        _row("cpu bf16-mixed compiled b64", "explicit", 7100.0, precision="bf16-mixed", compile=True, compile_s=3.0),
        _row("auto cpu b64", "auto", 6000.0, estimate_bytes=2**22),
    ]
    rows[2]["compile_cached"] = True  # its mark widens the cell
    console = Console(width=80, record=True)
    print_uncut(console, bench_table(result_of(*rows)))
    lines = console.export_text().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80, lines
    assert any("7,000" in line and "12*/1,234" in line for line in lines), lines
    assert any("7,100" in line and "3.0/-" in line for line in lines), lines


def test_a_failed_rows_error_is_shown_as_written_brackets_and_all():
    error = "RuntimeError: Missing key(s) in state_dict: [fc.weight]; see [/tmp/run]"
    failed = _row("cpu bf16-mixed b64", "explicit", None, error=error)
    text = shown(result_of(_row("naive cpu fp32 b64", "naive", 5000.0), failed))
    assert f"cpu bf16-mixed b64 failed: {error}" in " ".join(text.split())  # under the table, wrapped to its width


def test_a_failed_rows_long_error_does_not_widen_the_table_past_the_terminal():
    error = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x16 and 15x4) in a layer of the model"
    failed = _row("cpu bf16-mixed eager b64", "explicit", None, error=error)
    rows = [_row("naive cpu fp32 b64", "naive", 5000.0), failed]
    console = Console(width=80, record=True)
    print_uncut(console, bench_table(result_of(*rows)))
    text = console.export_text()
    assert max(len(line.rstrip()) for line in text.splitlines()) <= 80, text
    assert "5,000" in text and f"cpu bf16-mixed eager b64 failed: {error}" in " ".join(text.split()), text


def test_printed_to_a_file_or_pipe_the_widest_bench_table_is_not_cut(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    rows = [
        _row("naive cuda:0 fp32 b256", "naive", 51234.0),
        _row("cuda:0 bf16-mixed compiled b256", "explicit", 912345.0, compile=True, compile_s=12.0),
        _row("auto cuda:0 b256", "auto", 901234.0),
    ]
    for row in rows:
        row.update(device="cuda:0", tokens_per_s=row["samples_per_s"] * 1024.0, mfu=0.412, mfu_measured=0.5,
                   speedup_cpu_fp32=123.4, estimate_bytes=2**33)  # fmt: skip
    console = output_console()  # stdout is captured here: not a terminal
    assert not console.is_terminal
    with console.capture() as captured:
        console.print(bench_table(result_of(*rows)))
    text = captured.get()
    assert "…" not in text and "912,345" in text and "123.40x" in text
    monkeypatch.setenv("COLUMNS", "100")
    assert output_console().width == 100  # the user's own width wins


def test_in_a_narrow_terminal_no_figure_of_the_bench_table_is_cut_or_dropped():
    rows = [
        _row("naive cpu fp32 b64", "naive", 7982.5),
        _row("cpu bf16-mixed compiled b64", "explicit", 10791.0, compile=True, compile_s=3.0),
        _row("auto cpu b64", "auto", 8913.0),
    ]
    for row in rows:
        row.update(tokens_per_s=row["samples_per_s"] * 64.0, estimate_bytes=2**22, loss=0.5717)
    for width in (80, 60):
        console = Console(width=width, record=True)
        print_uncut(console, bench_table(result_of(*rows)))
        text = console.export_text()
        assert "…" not in text, text
        assert "10,791" in text and "690,624" in text and "0.572" in text and "3.0/-" in text, text
        names = " ".join(line[:12] for line in text.splitlines())  # the names wrap, never vanish
        assert all(word in names for word in ("auto", "naive", "fp32", "bf16-mixed", "b64")), text
        header = next(line for line in text.splitlines() if "config" in line)
        assert header.split()[-1] == "loss", text  # the last column is there, not cropped off the edge


def test_a_small_models_memory_is_not_shown_as_zero():
    small = _row("naive cpu fp32 b32", "naive", 5000.0, estimate_bytes=20_000)
    text = shown(result_of(small))
    assert "19.5 KiB" in text and "0 MiB" not in text, text
    assert [size(n) for n in (512, 3 * 2**20 + 2**19, 5 * 2**30)] == ["512 B", "3.5 MiB", "5.00 GiB"]


def test_a_small_models_share_of_matmul_is_not_shown_as_zero():
    # A small model on a CPU reaches 0.04% of the matmul: "0%" read as if it did nothing, or was not measured.
    cpu = _row("naive cpu fp32 b32", "naive", 5000.0, mfu_measured=0.00042)
    text = shown(result_of(cpu, _row("cpu fp32 eager b32", "explicit", 6000.0, mfu_measured=0.23)))
    assert " 0.04% " in text and " 23% " in text and " 0% " not in text, text
    gpu = _row("cuda fp32 eager b32", "explicit", 9000.0, device="cuda", mfu=0.0003, mfu_measured=0.0012)
    assert " 0.03%/0.1% " in shown(result_of(gpu, dict(gpu, name="auto cuda b32", mfu=0.412, mfu_measured=0.5)))


def test_the_best_line_says_what_auto_ran_and_whether_a_tuned_plan_set_it():
    naive = _row("naive cpu fp32 b64", "naive", 5000.0)
    auto = _row("auto cpu b64", "auto", 6000.0, precision="bf16-mixed")
    line = best_line(result_of(naive, auto))
    assert "fastest at batch 64: auto cpu b64, 1.20x the naive loop" in line
    assert "(what `redline train` runs: bf16-mixed, eager)" in line and ", the fastest" in line
    tuned = "tuned 2026-12-01 for 300 steps"
    plan = {"precision": {"value": "bf16-mixed", "reason": f"{tuned}: 1.31x fp32"},
            "grad_accum": {"value": 2, "reason": f"{tuned}: 2 micro-batches per step"}}  # fmt: skip
    eager = _row("cpu fp32 eager b64", "explicit", 8000.0)
    line = best_line(result_of(naive, eager, dict(auto, plan=plan)))
    assert "(what `redline train` runs: the tuned Plan: bf16-mixed, eager, 2 micro-batches a step)" in line
    assert "75% of the fastest" in line
    # a tuned channels_last (in the JSON's plan) went unsaid: "the tuned Plan: bf16-mixed, eager"
    plan = {"precision": {"value": "bf16-mixed", "reason": f"{tuned}: 1.31x fp32"},
            "channels_last": {"value": True, "reason": f"{tuned}: 1.12x NCHW"},
            "cuda_graphs": {"value": True, "reason": f"{tuned}: 1.05x eager"}}  # fmt: skip
    line = best_line(result_of(naive, dict(auto, plan=plan, channels_last=True)))
    assert "(what `redline train` runs: the tuned Plan: bf16-mixed, eager, CUDA graphs, channels_last)" in line


def test_the_best_line_gives_auto_its_round_by_round_interval_where_enough_rounds_ran():
    naive = _row("naive cpu fp32 b64", "naive", 5000.0)
    auto = _row("auto cpu b64", "auto", 4950.0)
    line = best_line(result_of(naive, dict(auto, speedup_naive_interval=[0.97, 1.02])))
    assert "auto cpu b64 (what `redline train` runs: fp32, eager): 0.99x the naive loop (round by round: " in line
    assert "0.97-1.02x, the median's 95% interval), 99% of the fastest" in line
    assert "round by round" not in best_line(result_of(naive, dict(auto, speedup_naive_interval=None)))
    # bimodal windows on a loaded machine: the median windows' ratio fell outside the rounds' own interval, said as is
    unsteady = best_line(result_of(naive, dict(auto, speedup_naive_interval=[0.64, 0.97], speedup_naive=1.84)))
    assert "(round by round: 0.64-0.97x, the median's 95% interval; the median windows' 1.84x lies outside it: " in (
        unsteady
    )
    assert "the machine's speed changed while the rounds ran" in unsteady and "outside" not in line


def test_the_best_line_where_the_naive_loop_failed_says_so_not_na():
    # fp32 out of memory where bf16 fits: the line read "cpu bf16-mixed eager b64, n/a the naive loop".
    naive = _row("naive cpu fp32 b64", "naive", None, error="OutOfMemoryError: CUDA out of memory")
    bf16 = _row("cpu bf16-mixed eager b64", "explicit", 6000.0, precision="bf16-mixed", speedup_naive=None)
    auto = _row("auto cpu b64", "auto", 5000.0, precision="bf16-mixed", speedup_naive=None)
    line = best_line(result_of(naive, bf16, auto))
    assert "fastest at batch 64: cpu bf16-mixed eager b64, no naive loop ran to compare with\n" in line
    assert "(what `redline train` runs: bf16-mixed, eager): no naive loop ran to compare with, 83% of the" in line
    assert "n/a" not in line


def test_a_slow_step_is_shown_in_whole_milliseconds_not_in_e_notation():
    slow = _row("naive cpu fp32 b64", "naive", 24.0, step_ms_p50=2662.4, step_ms_p90=3661.0)
    text = shown(result_of(slow, _row("cpu fp32 eager b64", "explicit", 5000.0, step_ms_p50=99.96, step_ms_p90=0.5)))
    assert "2662/3661" in text and "100/0.500" in text and "e+" not in text, text


def test_a_steps_p50_and_p90_keep_their_trailing_zeros_so_they_read_alike():
    # "4.98/5": the p90 of exactly 5 ms lost its digits beside the p50's
    text = shown(result_of(_row("naive cpu fp32 b64", "naive", 5000.0, step_ms_p50=4.98, step_ms_p90=5.0)))
    assert "4.98/5.00" in text, text
    text = shown(result_of(_row("naive cpu fp32 b64", "naive", 5000.0, step_ms_p50=0.57, step_ms_p90=12.0)))
    assert "0.570/12.0" in text, text


def test_the_title_says_why_the_steps_timed_are_not_the_steps_asked():
    row = _row("naive cpu fp32 b64", "naive", 5000.0)
    exact = shown({**result_of(row), "steps": 10, "steps_asked": 10})
    assert exact.splitlines()[0].rstrip() == "Bench of t: 10 timed steps per row, in windows of 5"
    rounded = " ".join(shown({**result_of(row), "steps": 15, "steps_asked": 12}).split())  # the title wraps
    assert "15 timed steps per row, in windows of 5 (12 asked, rounded up to whole windows, two at least)" in rounded
    stopped = " ".join(shown({**result_of(row), "steps": 10, "steps_asked": 60, "stopped_early": True}).split())
    assert "10 timed steps per row, in windows of 5 (of 60 asked: the time limit ended the timing early)" in stopped


def test_a_gpus_table_and_a_cpus_with_tokens_fit_80_columns_with_every_figure():
    # The widest of each, as `redline bench --devices cuda` and a CPU bench of a text task print them.
    gpu = [
        _row("naive cuda:0 fp32 b64", "naive", 24345.0),
        _row(
            "cuda:0 bf16-mixed compiled b64",
            "explicit",
            152345.0,
            compile=True,
            compile_s=12.0,
            break_even_steps=12345.0,
        ),
        _row("auto cuda:0 b64", "auto", 51345.0),
    ]
    for row in gpu:  # no CPU row ran: no speed-up over the CPU to show
        row.update(device="cuda:0", mfu=0.412, mfu_measured=0.5, estimate_bytes=int(3.9 * 2**20), speedup_cpu_fp32=None,
                   peak_mem_bytes=int(24.1 * 2**20), step_ms_p50=1.22, step_ms_p90=1.31, loss=0.178)  # fmt: skip
    cpu = [
        _row("naive cpu fp32 b32", "naive", 30.0, step_ms_p50=1076.0, step_ms_p90=1331.0),
        _row("cpu bf16-mixed compiled b32", "explicit", 44.0, compile=True, compile_s=23.7, break_even_steps=45),
        _row("auto cpu b32", "auto", 32.0, step_ms_p50=1016.0, step_ms_p90=1770.0),
    ]
    for row in cpu:
        row.update(tokens_per_s=row["samples_per_s"] * 64.0, mfu_measured=0.03, estimate_bytes=int(42.2 * 2**20),
                   peak_mem_bytes=int(559.6 * 2**20), peak_mem_kind="resident", loss=3.45)  # fmt: skip
    gpu_figures = ["152,345", "41.2%/50%", "24.1 MiB", "1.22/1.31", "12/12,345"]
    for rows, figures in ((gpu, gpu_figures), (cpu, ["1,920", "1076/1331", "24/45"])):
        console = Console(width=80, record=True)
        print_uncut(console, bench_table(result_of(*rows)))
        text = console.export_text()
        assert max(len(line.rstrip()) for line in text.splitlines()) <= 80, text
        assert all(figure in text for figure in figures) and "…" not in text, text
        assert "CPU" not in text.split("─")[0], text  # the header: no column of "n/a" speed-ups over the CPU


def test_a_row_whose_loss_went_not_finite_is_said_so_and_never_named_the_fastest():
    # fp16 without enough loss scaling, say: the fastest row, and no use, since it does not train.
    naive = _row("naive cpu fp32 b64", "naive", 5000.0, loss=2.1)
    diverged = _row("cpu fp16-mixed eager b64", "explicit", 8000.0, precision="fp16-mixed", loss=None)
    auto = _row("auto cpu b64", "auto", 7000.0, precision="fp16-mixed", loss=None)
    result = {"task": "t", "steps": 10, "window": 5, "rows": [naive, diverged, auto]}
    text = shown(result)
    assert sum("not finite" in line for line in text.splitlines() if "b64" in line) == 2, text
    assert "loss not finite: the last step's loss was NaN or inf" in text
    line = best_line(result)
    assert line.startswith("fastest at batch 64: naive cpu fp32 b64, 1.00x the naive loop (faster, but with a loss "
                           "not finite: cpu fp16-mixed eager b64, auto cpu b64)"), line  # fmt: skip
    assert "auto cpu b64 (what `redline train` runs: fp16-mixed, eager): 1.40x the naive loop, but its loss" in line
    alone = best_line({**result, "rows": [diverged]})
    assert alone.startswith("at batch 64 no configuration kept a finite loss"), alone


def test_the_shares_and_a_gpus_memory_say_what_they_are_of_under_the_table():
    gpu = _row("cuda fp32 eager b32", "explicit", 9000.0, device="cuda", mfu=0.41, mfu_measured=0.5)
    text = " ".join(shown(result_of(dict(gpu, peak_mem_kind="allocated"))).split())
    assert "MFU/of matmul: the achieved FLOP/s as a share of the catalog's dense peak for the GPU" in text
    assert "and of a square matmul's FLOP/s timed on the device in that precision" in text
    assert "memory on a GPU: the row's own tensors at their peak (allocated)" in text
    cpu = " ".join(shown(result_of(_row("cpu fp32 eager b32", "explicit", 60.0, mfu_measured=0.2))).split())
    assert "of matmul: the achieved FLOP/s as a share of a square matmul's FLOP/s" in cpu and "MFU/" not in cpu
    assert "memory on a GPU" not in cpu


def test_auto_rows_trial_is_said_under_the_table_marked_where_redlines_cache_served_it():
    eager = _row("cpu fp32 eager b64", "explicit", 6500.0)
    auto = _row("auto cpu b64", "auto", 7000.0, compile=True, compile_s=2.0, trial_s=1.13, trial_cached=False)
    text = " ".join(shown(result_of(eager, auto)).split())
    assert "auto cpu b64's precision trial: 1.1 s before its first step, counted in its repaid steps" in text
    assert "*" not in text
    text = " ".join(shown(result_of(eager, dict(auto, trial_s=0.01, trial_cached=True))).split())
    assert "auto cpu b64's precision trial: 0.0* s" in text
    assert "* beside a trial's seconds: redline's trial cache" in text and "a fresh machine the whole trial" in text
    assert "precision trial" not in shown(result_of(eager, dict(auto, trial_s=None)))


def test_an_fp32_row_whose_matmuls_ran_in_tf32_is_labelled_so_in_the_table_and_the_best_line():
    tf32 = {"tf32": {"value": True, "reason": "NVIDIA H100 has TF32 tensor cores"}}
    naive = _row("naive cuda fp32 b64", "naive", 5000.0, device="cuda")
    eager = _row("cuda fp32 eager b64", "explicit", 6500.0, device="cuda", plan=tf32)
    auto = _row("auto cuda b64", "auto", 7000.0, device="cuda", plan=tf32)
    result = result_of(naive, eager, auto)
    text = " ".join(shown(result).split())
    assert "cuda fp32 (TF32) eager b64" in text and "naive cuda fp32 b64" in text
    assert "fp32 (TF32): the row's fp32 matmuls ran in TF32" in text and "naive loop's ran in true fp32" in text
    assert "what `redline train` runs: fp32 (TF32), eager" in best_line(result)
    off = {"tf32": {"value": False, "reason": "not available on cpu"}}
    text = shown(result_of(_row("cpu fp32 eager b64", "explicit", 6500.0, plan=off)))
    assert "TF32" not in text
