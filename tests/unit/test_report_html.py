"""The HTML report: one self-contained page per bench result or run, its charts real PNGs, its text escaped."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from redline.cli.report import report as report_command
from redline.errors import ConfigError
from redline.render.html import bench_report, report, run_report, write_report
from report_samples import PNG_SIGNATURE, SUMMARY, bench_result, decoded_png, images, links, pixel_variance, write_run

pytest.importorskip("matplotlib", reason="the report's charts need the report extra: pip install 'redline[report]'")


def alts(doc):
    return [image["alt"] for image in images(doc)]


def test_bench_report_takes_what_benchmark_returns_as_its_to_dict_and_refuses_anything_else():
    class Returned:  # as redline.benchmark's BenchResult: it failed with "'BenchResult' object has no attribute 'get'"
        def to_dict(self):
            return bench_result()

    assert bench_report(Returned()) == bench_report(bench_result())
    with pytest.raises(ConfigError, match=r"result='list' is not allowed; expected a BenchResult or its to_dict\(\)"):
        bench_report([])


def test_bench_report_charts_the_rows_that_ran_and_tables_every_row():
    doc = bench_report(bench_result())
    assert doc.startswith("<!DOCTYPE html>") and doc.rstrip().endswith("</html>")
    assert "<title>redline bench: digits, 2026-12-01 06:10 UTC</title>" in doc
    assert "Best configuration: <strong>auto</strong>, 1.40x the naive loop (7,000 samples/s)" in doc
    assert "AMD EPYC 7B13 (2 cores, avx512_bf16)" in doc and "2.13.0" in doc
    # throughput, speed-up and memory; no tokens/s chart (no row has it), no MFU chart (every MFU is null)
    titles = [alt.split(":")[0] for alt in alts(doc)]
    assert titles == ["Throughput", "Speed-up over the naive loop", "Peak memory"]
    assert "MFU: not available for any configuration" in doc
    throughput = alts(doc)[0]
    assert "naive cpu fp32 5,000" in throughput and "auto 7,000" in throughput
    assert "cpu compiled" not in throughput  # the failed row is in the table, not in the charts
    assert "auto 1.40x" in alts(doc)[1] and "cpu bf16-mixed 143.1 MiB" in alts(doc)[2]
    table = doc.split("<h2>Every configuration</h2>", 1)[1]
    for field in bench_result()["rows"][0]:
        if field != "plan":
            assert f"<th>{field}</th>" in table, field
    assert '<tr class="failed"><td>cpu compiled</td>' in table
    assert "InductorError: no C++ compiler &amp; no cache" in table
    assert "measured: 1.40x fp32 on this CPU, 8 steps each" in doc  # the auto row's Plan, with its reasons


def test_a_compile_torchs_on_disk_caches_served_says_so_in_its_cell_and_a_note():
    result = bench_result()
    warm = dict(result["rows"][1], name="cpu fp32 compiled", compile=True, compile_s=0.25, compile_cached=True)
    result["rows"].append(warm)
    table = bench_report(result).split("<h2>Every configuration</h2>", 1)[1]
    assert '<td class="num">0.25 (cached)</td>' in table and "<th>compile_cached</th>" not in table
    assert "compile_s (cached): torch&#x27;s on-disk compile caches" in table
    warm["compile_cached"] = False
    table = bench_report(result).split("<h2>Every configuration</h2>", 1)[1]
    assert '<td class="num">0.25</td>' in table and "(cached)" not in table


def test_bench_report_draws_tokens_and_mfu_for_the_rows_that_have_them():
    result = bench_result()
    for row, mfu in zip(result["rows"], (0.31, None, None, 0.42), strict=True):
        row.update(mfu=mfu, tokens_per_s=row["samples_per_s"] and row["samples_per_s"] * 128)
    doc = bench_report(result)
    by_title = {alt.split(":")[0]: alt for alt in alts(doc)}
    assert "auto 896,000" in by_title["Token throughput"]
    mfu = by_title["Model FLOP utilisation (MFU)"]
    assert "naive cpu fp32 31.0%" in mfu and "auto 42.0%" in mfu and "bf16" not in mfu
    assert "MFU: not available" not in doc


def test_a_bench_where_every_row_failed_still_reports():
    result = bench_result()
    result["rows"] = [row for row in result["rows"] if row["error"]]
    doc = bench_report(result)
    assert "No configuration completed" in doc and images(doc) == []
    assert "cpu compiled</strong> failed: InductorError" in doc


def test_the_page_loads_nothing_and_every_chart_is_a_png_that_is_not_blank(tmp_path):
    for doc in (bench_report(bench_result()), run_report(write_run(tmp_path))):
        assert not re.search(r"https?://|(src|href)=\"//", doc)
        assert "<script" not in doc.lower()
        assert all(link.startswith("data:") for link in links(doc)), links(doc)
        assert images(doc)
        for image in images(doc):
            assert image["alt"] and image["width"] and image["height"]
            png = decoded_png(image["src"])
            assert png.startswith(PNG_SIGNATURE)
            assert pixel_variance(png) > 0


def test_every_string_from_a_result_is_escaped():
    result = bench_result()
    result["task"] = "<script>alert(1)</script>"
    result["machine"]["cpu"] = 'EPYC "quoted" & <b>bold</b>'
    result["rows"][3]["name"] = "auto <img src=x>"
    result["rows"][3]["plan"]["precision"]["reason"] = "measured: <1.4x> & more"
    doc = bench_report(result)
    assert "<script" not in doc and "&lt;script&gt;alert(1)&lt;/script&gt;" in doc
    assert "<b>bold</b>" not in doc and "&lt;b&gt;bold&lt;/b&gt;" in doc
    assert "<img src=x>" not in doc and "auto &lt;img src=x&gt;" in doc
    assert "measured: &lt;1.4x&gt; &amp; more" in doc


def test_run_report_draws_the_curves_and_tables_the_summary_and_plan(tmp_path):
    doc = run_report(write_run(tmp_path))
    assert "<title>redline run: digits</title>" in doc
    assert "30 steps, final loss 0.52 (mean of the last steps), val loss 0.61, val metric 0.81, 6,400 samples/s." in doc
    titles = [alt.split(":")[0] for alt in alts(doc)]
    assert titles == ["Loss", "Throughput", "Memory", "Step time"]  # no tokens/s: the task has none
    loss = alts(doc)[0]
    assert "train loss over 30 points" in loss and "val loss over 3 points" in loss
    assert "<td>precision</td><td>fp32</td><td>auto: no AMX; bf16 would be slower here</td>" in doc
    assert "<td>compile</td><td>off</td>" in doc
    assert "<strong>stopped</strong></td><td>max_steps</td>" in doc
    assert "Read from metrics.jsonl and eval.jsonl" in doc


def test_the_csv_logs_give_the_same_report_as_the_jsonl_ones(tmp_path):
    run = write_run(tmp_path)
    from_jsonl = alts(run_report(run))
    (run / "metrics.jsonl").unlink()
    (run / "eval.jsonl").unlink()
    doc = run_report(run)
    assert alts(doc) == from_jsonl and "Read from metrics.csv and eval.csv" in doc


def test_a_run_without_a_summary_is_drawn_from_its_logs(tmp_path):
    run = write_run(tmp_path, summary=None)
    with (run / "metrics.jsonl").open("a") as file:
        file.write('{"step": 31, "loss": NaN, "samples_per_s": 7000.0}\n')  # a diverged step, as json writes it
        file.write('{"step": 32, "loss": 1.0, "samp')  # the row the killed run was writing
    doc = run_report(run)
    assert "the run stopped at step 31, where its loss was not finite" in doc  # not "still going": it diverged
    assert "still going" not in doc and "<h2>Plan</h2>" not in doc
    assert "31 steps." in doc
    assert "train loss over 30 points" in alts(doc)[0]  # NaN is a gap in the curve, not a broken chart
    assert "samples/s over 31 points, last 7,000" in alts(doc)[1]
    # the gap is at the end, where the curve cannot show it: the page says so
    assert "not finite (NaN or inf) at 1 of 31 logged steps, the first at step 31" in doc
    assert "the curve leaves them out, and the run diverged there." in doc


def test_a_run_without_a_summary_whose_last_loss_is_finite_is_still_going_or_killed(tmp_path):
    doc = run_report(write_run(tmp_path, summary=None))
    assert "no summary.json yet, so the run is still going or was stopped before it ended" in doc
    assert "where its loss was not finite" not in doc


def test_a_validation_loss_that_is_not_finite_is_said_not_shown_as_not_evaluated(tmp_path):
    # summary.json stores the NaN as null: the report showed "—", as for a run that never evaluated, and no note
    run = write_run(tmp_path, summary={**SUMMARY, "val_loss": None})
    with (run / "eval.jsonl").open("a") as file:
        file.write('{"step": 30, "val_loss": NaN, "val_metric": 0.1}\n')
    doc = run_report(run)
    assert "The validation loss in eval.jsonl is not finite (NaN or inf) at 1 of 4 logged steps, the first at " in doc
    assert "where the train loss stays finite, the model is sound: check val_data for NaN" in doc
    assert "diverged" not in doc  # its training loss is finite: it said "and the run diverged there"
    assert "val loss not finite" in doc  # the line at the top
    assert re.search(r"<strong>val_loss</strong></td>\s*<td[^>]*>not finite</td>", doc), "the summary table"
    write_run(tmp_path, summary={**SUMMARY, "val_loss": None})  # evaluated, with finite losses: no such note
    assert "not finite" not in run_report(tmp_path)


def test_a_validation_metric_that_is_not_finite_is_said_in_the_summary_table_too(tmp_path):
    # The line at the top said "val metric not finite" while the summary table showed "—", as if never evaluated
    run = write_run(tmp_path, summary={**SUMMARY, "val_metric": None})
    with (run / "eval.jsonl").open("a") as file:
        file.write('{"step": 30, "val_loss": 0.5, "val_metric": NaN}\n')
    doc = run_report(run)
    assert "val metric not finite" in doc
    assert re.search(r"<strong>val_metric</strong></td>\s*<td[^>]*>not finite</td>", doc), "the summary table"


def test_a_run_whose_every_loss_is_not_finite_says_so_instead_of_an_empty_chart(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": NaN}\n{"step": 2, "loss": Infinity}\n')
    doc = run_report(run)
    assert not [alt for alt in alts(doc) if alt.startswith("Loss")], alts(doc)  # it drew an empty chart, alt "Loss: "
    assert "metrics.jsonl is not finite (NaN or inf) at every logged step, the first at step 1" in doc
    (run / "metrics.jsonl").write_text('{"step": 1, "samples_per_s": 10.0}\n')  # a log without the loss
    doc = run_report(run)
    assert "Loss: metrics.jsonl holds no loss value." in doc and not alts(doc)[0].startswith("Loss"), alts(doc)
    assert "holds no loss value" not in run_report(write_run(tmp_path / "full"))


def test_a_jsonl_log_an_earlier_run_left_beside_a_newer_csv_is_not_drawn(tmp_path):
    # An --out reused by a run with --logger csv alone: the earlier run's JSONL logs stay as they were.
    run = write_run(tmp_path, steps=30)
    old = time.time() - 3600
    for name in ("metrics.jsonl", "eval.jsonl", "summary.json"):
        os.utime(run / name, (old, old))
    rows = (run / "metrics.csv").read_text().splitlines(keepends=True)
    (run / "metrics.csv").write_text("".join(rows[:6]))  # the new run: 5 steps so far
    doc = run_report(run)
    assert "train loss over 5 points" in alts(doc)[0] and "5 steps." in doc
    assert "Read from metrics.csv and eval.csv" in doc
    # the earlier run's summary.json is not this run's: it said "30 steps on cpu (stopped: max_steps)"
    assert "summary.json is older than metrics.csv (an earlier run" in doc and "<h2>Summary</h2>" not in doc
    assert "train loss over 30 points" in alts(run_report(write_run(tmp_path / "both")))[0]  # one run's: JSONL


def test_a_jsonl_log_a_resume_added_is_not_drawn_where_the_csv_holds_the_run_from_its_start(tmp_path):
    # --logger csv, then a resume with the default loggers: the JSONL starts at the resumed step, and the report
    # drew the curve from there alone, half the run missing.
    run = write_run(tmp_path, steps=30)
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(rows[15:]))  # resumed at step 15
    doc = run_report(run)
    assert "train loss over 30 points" in alts(doc)[0] and "Read from metrics.csv" in doc


def test_a_resumed_runs_rates_are_said_to_be_those_since_the_resume(tmp_path):
    summary = json.loads(json.dumps(SUMMARY))
    summary["resumed_from"] = str(tmp_path / "run" / "checkpoints" / "step-00000020")
    doc = run_report(write_run(tmp_path, summary=summary))
    assert "the rates since the resume from step-00000020." in doc
    assert "since the resume" not in run_report(write_run(tmp_path / "whole"))


def test_html_dash_is_refused_rather_than_written_as_a_file_named_dash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"--html '-' would write a file named '-'.*\nhint: name a .html file") as e:
        report_command(write_run(tmp_path / "run"), html=Path("-"))
    assert str(e.value).endswith("e.g. --html report.html")  # a run's page: bench's --json is no help here
    assert not (tmp_path / "-").exists()


def test_a_csv_row_a_killed_run_left_half_written_is_not_drawn_as_a_step(tmp_path):
    run = write_run(tmp_path, summary=None)
    (run / "metrics.jsonl").unlink()
    with (run / "metrics.csv").open("a") as file:
        file.write("31,0,0.41,0.001,71")  # cut inside samples/s (7,240): it parses, its later cells empty
    doc = run_report(run)
    assert "30 steps." in doc
    assert "samples/s over 30 points, last 7,200" in alts(doc)[1]
    one = (run / "metrics.csv").read_text().splitlines(keepends=True)[:2]  # the header and the first step
    (run / "metrics.csv").write_text("".join(one))
    assert "1 step." in run_report(run)
    (run / "metrics.csv").write_text("step,epoch,lo")  # a run killed as it wrote its header
    assert "metrics.csv holds no step yet" in run_report(run)


def test_a_finished_run_copied_elsewhere_keeps_its_summary_whatever_the_files_times(tmp_path):
    # cp -r, scp -r, an artifact's download: each file is stamped as it arrives, summary.json perhaps first
    run = write_run(tmp_path, steps=30)
    old = time.time() - 60
    os.utime(run / "summary.json", (old, old))
    doc = run_report(run)
    assert "<h2>Summary</h2>" in doc and "<h2>Plan</h2>" in doc and "is older than" not in doc


def test_a_resumed_run_that_has_not_ended_is_not_shown_with_the_summary_it_resumed_from(tmp_path):
    run = write_run(tmp_path, steps=45)  # resumed from step 30, whose summary.json stays until the run ends
    doc = run_report(run)
    assert "summary.json ends at step 30 but the logs go on past it" in doc
    assert "45 steps." in doc and "stopped: max_steps" not in doc and "<h2>Summary</h2>" not in doc
    assert "30 steps" not in doc


def test_a_plan_that_is_not_a_table_of_axes_is_shown_as_its_text(tmp_path):
    run = write_run(tmp_path, summary={**SUMMARY, "plan": ["cpu", "<fp32>"]})
    assert "<h2>Plan</h2>\n<pre>[&quot;cpu&quot;, &quot;&lt;fp32&gt;&quot;]</pre>" in run_report(run)


def test_report_writes_run_dir_report_html_atomically(tmp_path):
    run = write_run(tmp_path / "run")
    written = report(run)
    assert written == run / "report.html" and written.read_text().startswith("<!DOCTYPE html>")
    elsewhere = report(str(run), tmp_path / "other.html")
    assert elsewhere == tmp_path / "other.html" and elsewhere.is_file()
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    assert write_report(tmp_path / "x.html", "<p>new</p>").read_text() == "<p>new</p>"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no dir", r"run directory '.*missing' does not exist\nhint: pass the directory a run wrote with --out"),
        ("no logs", r"has no metrics.jsonl or metrics.csv.*\nhint: .*--logger"),
        (
            "bad summary",
            r"summary.json cannot be read: .*\nhint: restore summary.json from the run, or delete it: "
            r"the report then draws the run from its logs, as one that has not ended$",
        ),
        (  # every row: one damaged among good ones is left out (see below)
            "bad rows",
            r"metrics.jsonl cannot be read: line 1: .*\nhint: restore metrics.jsonl from the run, or delete "
            r"it: the report then reads metrics.csv in its place, if the run wrote one$",
        ),
        ("no step", r"metrics.jsonl cannot be read: line 1: it has no 'step'\nhint: restore metrics.jsonl"),
        (  # another tool's JSON written over it (a trace of `redline profile --trace`, before it refused that)
            "trace as summary",
            r"summary.json cannot be read: it is not a run's summary: no task or steps in it \(its keys: "
            r"schemaVersion, traceEvents\)\nhint: restore summary.json",
        ),
        (
            "bad csv",
            r"metrics.csv cannot be read: line 2: could not convert string to float: 'one'\nhint: restore "
            r"metrics.csv from the run: the report draws its curves from it$",
        ),
    ],
)
def test_a_missing_or_unreadable_run_is_a_config_error_that_names_the_file(tmp_path, damage, message):
    run = write_run(tmp_path / "run")
    if damage == "no dir":
        run = tmp_path / "missing"
    elif damage == "no logs":
        for log in ("metrics.jsonl", "metrics.csv", "summary.json"):  # with its summary, its page is drawn (below)
            (run / log).unlink()
        (run / "model.safetensors").write_bytes(b"")  # a run that ended: its evaluations alone say it never logged
    elif damage == "bad summary":
        (run / "summary.json").write_text("{not json")
    elif damage == "trace as summary":
        (run / "summary.json").write_text('{"schemaVersion": 1, "traceEvents": []}')
    elif damage in ("bad rows", "no step"):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        bad = "garbage" if damage == "bad rows" else '{"loss": 1.0}'
        (run / "metrics.jsonl").write_text(f"{bad}\n" * len(lines))
    else:
        (run / "metrics.jsonl").unlink()
        header = (run / "metrics.csv").read_text().splitlines()[0]
        (run / "metrics.csv").write_text(f"{header}\none{',' * header.count(',')}\n")
    with pytest.raises(ConfigError, match=message):
        run_report(run)


def test_rows_damaged_among_good_ones_are_left_out_and_named_and_the_page_is_drawn(tmp_path, caplog):
    """One bad row stopped the whole report, and the hint said to delete the log; a stray quote in a CSV cell put
    the rest of the file into the message."""
    run = write_run(tmp_path / "run", steps=30)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join([*lines[:10], "garbage{{", *lines[10:]]) + "\n")
    with (run / "eval.jsonl").open("a") as file:
        file.write("garbage\n")  # a whole line, not a killed write's cut: damage
    with caplog.at_level("WARNING", logger="redline"):
        doc = run_report(run)
    assert "train loss over 30 points" in alts(doc)[0]
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"{run / 'metrics.jsonl'}: 1 damaged row(s) left out") and "line 11: " in m for m in said)
    assert any(m.startswith(f"{run / 'eval.jsonl'}: 1 damaged row(s) left out") for m in said), said
    csv_only = write_run(tmp_path / "csv", steps=30)
    (csv_only / "metrics.jsonl").unlink()
    rows = (csv_only / "metrics.csv").read_text().splitlines()
    (csv_only / "metrics.csv").write_text("\n".join([*rows[:5], '5,"2', *rows[5:]]) + "\n")
    caplog.clear()
    with caplog.at_level("WARNING", logger="redline"):
        run_report(csv_only)
    said = [r.getMessage() for r in caplog.records if "damaged row" in r.getMessage()]
    assert len(said) == 1 and len(said[0]) < 400, said  # the cell cut short, not the rest of the file
    assert "lines 6-32: could not convert string to float: '2\\n5,0" in said[0]  # and what it took in


def test_a_run_directory_whose_name_is_not_utf8_gets_its_page(tmp_path):
    """Its name, shown on the page, held lone surrogates that UTF-8 cannot encode: a traceback, no page."""
    import os

    run = write_run(Path(os.fsdecode(bytes(tmp_path) + b"/run\xff")), steps=5)
    written = report(run)
    assert "train loss over 5 points" in alts(written.read_text(encoding="utf-8"))[0]


def test_a_jsonl_log_with_a_gap_is_not_drawn_where_the_csv_holds_every_step(tmp_path):
    # resumed with --logger csv (the JSONL misses those steps), then again with both: the report drew the JSONL's
    # line straight across the gap
    run = write_run(tmp_path, steps=30)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:10] + lines[20:]))
    doc = run_report(run)
    assert "train loss over 30 points" in alts(doc)[0] and "Read from metrics.csv" in doc


def test_a_checkpoint_given_for_its_run_names_the_run_directory(tmp_path):
    run = write_run(tmp_path / "run")
    checkpoint = run / "checkpoints" / "step-00000030"
    checkpoint.mkdir(parents=True)
    for given in (checkpoint, checkpoint.parent):
        with pytest.raises(
            ConfigError, match=rf"has no metrics.jsonl.*\nhint: {run} holds the run's logs: redline report {run}$"
        ):
            run_report(given)


def test_a_bench_saved_as_json_gets_its_page_without_running_again(tmp_path, capsys):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(bench_result()))  # what `redline bench --json > bench.json` wrote
    assert report(saved) == tmp_path / "bench.html"
    doc = (tmp_path / "bench.html").read_text()
    assert "<title>redline bench: digits" in doc and "Best configuration: <strong>auto</strong>" in doc
    report_command(saved, tmp_path / "elsewhere.html")
    assert capsys.readouterr().out == f"{tmp_path / 'elsewhere.html'}\n"
    (tmp_path / "other.json").write_text('{"task": "digits"}')
    with pytest.raises(ConfigError, match=r"other.json is not a bench result: it has no list of rows\nhint: pass"):
        report(tmp_path / "other.json")


def test_a_page_asked_over_a_file_the_report_reads_is_refused_and_the_file_kept(tmp_path):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(bench_result()))
    with pytest.raises(ConfigError, match=r"bench\.json' is a file the report is made from: the page would replace it"):
        report(saved, saved)
    assert json.loads(saved.read_text())["task"] == "digits"  # it was replaced by the page
    run = write_run(tmp_path / "run")
    kept = (run / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"hint: name another file, e\.g\. --html .*run/report\.html$"):
        report(run, run / "metrics.jsonl")
    assert (run / "metrics.jsonl").read_text() == kept
    assert report(run, run / "notes.html") == run / "notes.html"
    assert report(run, run / "notes.html") == run / "notes.html"  # an earlier page is replaced
    # any other file of the run too: before, --html RUN/model.safetensors replaced the trained weights, exit 0
    (run / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ConfigError, match=r"model\.safetensors' is a file that is no page \(not \.html\)") as refused:
        report(run, run / "model.safetensors")
    assert str(refused.value).endswith(f"hint: name a .html file, e.g. --html {run / 'model.html'}")
    assert (run / "model.safetensors").read_bytes() == b"weights"


def test_figures_a_json_holds_as_nan_or_infinity_are_no_figures_and_sizes_keep_their_unit(tmp_path):
    """Before, an Infinity (Python's json writes it) stopped the page with matplotlib's ValueError, and every
    estimate under a GiB read "0.00 GiB"."""
    result = bench_result()
    result["rows"][0]["samples_per_s"] = float("inf")
    result["rows"][1]["speedup_naive"] = float("nan")
    for row in result["rows"]:
        row["estimate_bytes"] = 4_076_736
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(result))
    doc = report(saved).read_text()
    assert '<td class="num">3.9 MiB</td>' in doc and "0.00 GiB" not in doc
    assert ">inf<" not in doc and ">nan<" not in doc  # the cells read "inf" and "nan"
    assert doc.count('<td class="num">—</td>') >= 2


def test_a_rows_speedup_interval_reads_as_a_range_not_a_json_list():
    result = bench_result()
    result["rows"][1]["speedup_naive_interval"] = [0.9712, 1.0234]
    doc = bench_report(result)
    assert ">0.97-1.02x</td>" in doc and "[0.9712" not in doc


def test_the_bench_page_names_no_row_whose_loss_went_not_finite_the_best():
    result = bench_result()
    for row in result["rows"]:
        row["loss"] = 2.0
    result["rows"][3]["loss"] = None  # auto, the fastest, ended on a NaN loss (kept as None in the JSON)
    doc = bench_report(result)
    assert "Best configuration: <strong>cpu bf16-mixed</strong>" in doc
    assert ">not finite</td>" in doc
    for row in result["rows"]:
        row["loss"] = None
    assert "No configuration kept a finite loss" in bench_report(result)


def test_the_bench_page_names_the_fastest_of_each_batch_size_as_the_terminal_does():
    # It named the highest samples/s of every batch size, where the terminal's best line names one per size: a
    # larger batch's rows outrun a smaller one's without being a better configuration
    from redline.render.bench import best_line
    from report_samples import _row

    result = bench_result()
    result["rows"] = [
        _row("naive cpu fp32 b32", "naive", 3000.0, batch_size=32),
        _row("cpu fp32 eager b32", "explicit", 3600.0, batch_size=32, speedup_naive=1.2),
        _row("naive cpu fp32 b64", "naive", 5000.0),
        _row("auto cpu b64", "auto", 5500.0, speedup_naive=1.1),
    ]
    doc = bench_report(result)
    assert "Best configuration at batch 32: <strong>cpu fp32 eager b32</strong>, 1.20x the naive loop" in doc
    assert "Best configuration at batch 64: <strong>auto cpu b64</strong>, 1.10x the naive loop" in doc
    terminal = best_line(result)
    assert "fastest at batch 32: cpu fp32 eager b32" in terminal and "fastest at batch 64: auto cpu b64" in terminal


def test_a_bench_json_that_is_missing_or_has_rows_that_are_not_objects_is_refused_as_a_bench_result(tmp_path):
    with pytest.raises(ConfigError, match=r"'.*gone\.json' does not exist\nhint: pass the file `redline bench --json"):
        report(tmp_path / "gone.json")  # it said "run directory '.../gone.json' does not exist"
    (tmp_path / "odd.json").write_text('{"rows": [{"name": "x"}, "y"]}')  # an AttributeError traceback
    with pytest.raises(ConfigError, match=r"odd\.json is not a bench result: its row 2 is not an object\nhint: pass"):
        report(tmp_path / "odd.json")


def test_a_run_that_has_not_logged_yet_is_told_apart_from_a_directory_that_is_no_run(tmp_path):
    starting = tmp_path / "starting"  # what `redline train --out starting` holds before its first log
    (starting / "checkpoints").mkdir(parents=True)
    (starting / ".write-check-x").write_text("")
    with pytest.raises(ConfigError, match=r"holds no metrics yet: a run writes .* when it first logs .*\nhint: if the"):
        report(starting)
    # One killed before its first log, after an evaluation: before, "has no metrics ... pass the directory a run
    # wrote with --out", which it was.
    (starting / "eval.jsonl").write_text('{"step": 22, "val_loss": 0.5}\n')
    with pytest.raises(ConfigError, match=r"holds no metrics yet: .*\nhint: .*; one stopped before then logged no st"):
        report(starting)
    (tmp_path / "other" / "notes.txt").parent.mkdir()
    (tmp_path / "other" / "notes.txt").write_text("")
    with pytest.raises(ConfigError, match=r"other has no metrics.jsonl or metrics.csv: the report draws"):
        report(tmp_path / "other")


def test_a_file_of_a_run_given_for_the_run_names_its_directory(tmp_path):
    run = write_run(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"is not a directory\nhint: {run} holds the run's logs: redline report"):
        report(run / "summary.json")


def test_writing_where_no_file_can_go_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(
        ConfigError, match=r"cannot be written to .* \(.*file is a file, not a directory\)\nhint: .*--html FILE"
    ):
        write_report(tmp_path / "file" / "such" / "dir.html", "<p></p>")


def test_a_report_into_a_missing_directory_creates_it(tmp_path):
    written = write_report(tmp_path / "no" / "such" / "page.html", "<p></p>")
    assert written.read_text(encoding="utf-8") == "<p></p>"
    page = tmp_path / "pages" / "run.html"
    assert report(write_run(tmp_path / "run"), page) == page and page.read_text(encoding="utf-8").startswith("<!DOC")


def test_without_matplotlib_the_error_says_how_to_install_it(monkeypatch, tmp_path):
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for make in (lambda: bench_report(bench_result()), lambda: run_report(write_run(tmp_path))):
        with pytest.raises(ConfigError, match=r"matplotlib.*\nhint: pip install 'redline\[report\]'"):
            make()


KEEPS_THE_USERS_BACKEND = """
import json, sys
import redline
redline.report  # the public name resolves without importing matplotlib
assert "matplotlib" not in sys.modules, "redline.report imported matplotlib"
import matplotlib
matplotlib.use("svg")
from redline.render.html import bench_report
sys.path.insert(0, sys.argv[1])
from report_samples import bench_result
bench_report(bench_result())
print(json.dumps({"pyplot": "matplotlib.pyplot" in sys.modules, "backend": matplotlib.get_backend()}))
"""


def test_the_charts_leave_the_callers_matplotlib_backend_alone(request):
    tests = str(request.config.rootpath / "tests")
    out = subprocess.run(
        [sys.executable, "-c", KEEPS_THE_USERS_BACKEND, tests], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout) == {"pyplot": False, "backend": "svg"}


def test_a_share_too_small_for_its_decimals_keeps_its_first_digit_in_the_page():
    result = bench_result()
    result["rows"][0].update(mfu=0.00042, mfu_measured=0.000031)  # a small model: "0.0%" read as nothing done
    table = bench_report(result).split("<h2>Every configuration</h2>", 1)[1]
    assert '<td class="num">0.04%</td><td class="num">0.003%</td>' in table


def test_a_bench_saved_under_another_name_than_json_gets_its_page(tmp_path):
    # `redline bench --json > bench.out` was refused as "run directory 'bench.out' is not a directory", its hint
    # naming a run's --out: a bench result was told to be something else.
    for name, page in (("bench.out", "bench.html"), ("BENCH.JSON", "BENCH.html"), ("results", "results.html")):
        (tmp_path / name).write_text(json.dumps(bench_result()))
        assert report(tmp_path / name) == tmp_path / page
        assert "<title>redline bench: digits" in (tmp_path / page).read_text()
    (tmp_path / "notes.txt").write_text("not a bench")
    with pytest.raises(ConfigError, match=r"notes\.txt cannot be read as a bench result: .*\nhint: pass the file"):
        report(tmp_path / "notes.txt")
    run = write_run(tmp_path / "run")  # a run's own file still names the run to report
    with pytest.raises(ConfigError, match=f"is not a directory\nhint: {run} holds the run's logs"):
        report(run / "metrics.csv")


def test_a_page_asked_into_a_directory_is_refused_naming_a_file_to_pass(tmp_path):
    # It said "the report cannot be written to '...' (Is a directory)", with no file to pass instead.
    run = write_run(tmp_path / "run")
    where = re.escape(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"--html '{where}' is a directory\nhint: .* --html {where}/report\.html"):
        report(run, tmp_path)
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps(bench_result()))
    named = rf"is a directory\nhint: name a file, e\.g\. --html {re.escape(str(run))}/bench\.html$"
    with pytest.raises(ConfigError, match=named):
        report(saved, run)


def test_a_default_page_path_that_cannot_be_written_is_refused_without_naming_html(tmp_path):
    # `redline report dd.json` beside a directory dd.html said "--html 'dd.html' is a directory": no --html was given
    saved = tmp_path / "dd.json"
    saved.write_text(json.dumps(bench_result()))
    (tmp_path / "dd.html").mkdir()
    where = re.escape(str(tmp_path / "dd.html"))
    told = rf"^the page's default path '{where}' is a directory\nhint: pass --html FILE, e\.g\. --html {where}/dd"
    with pytest.raises(ConfigError, match=told + r"\.html$"):
        report(saved)
    run = write_run(tmp_path / "run")
    (run / "report.html").mkdir()
    with pytest.raises(ConfigError, match=r"^the page's default path '.*/run/report\.html' is a directory\nhint: pass"):
        report(run)
    (tmp_path / "b.html").write_text(json.dumps(bench_result()))  # a result saved as .html: its page would be itself
    told = r"^the page's default path '.*/b\.html' is a file the report is made from: .*\nhint: pass --html FILE"
    with pytest.raises(ConfigError, match=told + r", e\.g\. --html .*/b-report\.html$"):
        report(tmp_path / "b.html")
    assert json.loads((tmp_path / "b.html").read_text())["task"] == "digits"


def test_a_page_redline_did_not_make_is_kept_and_an_earlier_one_of_redlines_replaced(tmp_path):
    # `--html mine.html`, and `redline report b.json` writing b.html beside it, replaced a page written by hand
    saved = tmp_path / "b.json"
    saved.write_text(json.dumps(bench_result()))
    mine = "<!DOCTYPE html><html><body><p>my notes</p><footer>by me</footer></body></html>"
    for page in (tmp_path / "mine.html", tmp_path / "b.html"):
        page.write_text(mine)
        told = f"--html {str(page)!r}" if page.name == "mine.html" else f"the page's default path {str(page)!r}"
        hint = rf"hint: name another file, e\.g\. --html .*/{page.stem}-report\.html, or delete"
        with pytest.raises(ConfigError, match=rf"^{re.escape(told)} is a page redline did not make: .*\n{hint}"):
            report(saved, page if page.name == "mine.html" else None)
        assert page.read_text() == mine
    (tmp_path / "b.html").unlink()
    assert report(saved) == tmp_path / "b.html" and report(saved) == tmp_path / "b.html"  # its own page, again
    older = tmp_path / "older.html"  # an earlier version's, and an empty file: nothing of the user's to lose
    older.write_text("<html><body>...<footer>Made by redline 0.0.1. Read from metrics.jsonl in r.</footer></body>")
    (tmp_path / "empty.html").touch()
    for page in (older, tmp_path / "empty.html"):
        assert report(saved, page) == page and "<title>redline bench: digits" in page.read_text()


def test_a_run_reported_as_the_current_directory_is_named_by_it(tmp_path, monkeypatch):
    # `redline report .` in a run still going titled the page "redline run: " (the name of "." is empty).
    run = tmp_path / "run-7"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    monkeypatch.chdir(run)
    assert "<title>redline run: run-7</title>" in report(".").read_text(encoding="utf-8")


def test_a_finished_run_that_logged_nothing_gets_its_summary_and_plan(tmp_path):
    """Trained with no logger (loggers=()), it could not be reported: 'has no metrics.jsonl or metrics.csv'. Its
    page said "The run logged no metrics (no logger)", of a run whose log was removed since as well."""
    run = write_run(tmp_path / "run")
    for log in ("metrics.jsonl", "metrics.csv", "eval.jsonl", "eval.csv"):
        (run / log).unlink()
    doc = run_report(run)
    assert "No metrics file was found (a run with no logger writes none), so there is no curve to draw." in doc
    assert "<h2>Summary</h2>" in doc and "Read from summary.json in" in doc


def test_the_page_tells_a_compile_never_repaid_from_one_with_nothing_to_compare_and_a_cpus_memory_as_the_process(
    monkeypatch,
):
    """The page showed "—" for both, where the terminal says "never" and "-"; its memory chart called a CPU's
    resident set, which only grows from row to row, "the peak of a training step"."""
    from redline.render import html
    from report_samples import _row

    result = bench_result()
    result["rows"] = [
        _row("cpu fp32 eager", "explicit", 5000.0, peak_mem_kind="resident"),
        _row("cpu fp32 compiled", "explicit", 4000.0, compile=True, compile_s=2.5, peak_mem_kind="resident"),
        _row("cpu bf16 compiled", "explicit", 6000.0, precision="bf16-mixed", compile=True, compile_s=2.0),
    ]
    result["rows"][2]["peak_mem_kind"] = "resident"
    labels = []
    real = html._bars

    def drawn(rows, key, **options):
        labels.append((key, options["xlabel"]))
        return real(rows, key, **options)

    monkeypatch.setattr(html, "_bars", drawn)
    table = bench_report(result).split("<h2>Every configuration</h2>", 1)[1]
    cells = re.findall(r"<tr[^>]*><td>(cpu [^<]+)</td>(.*?)</tr>", table, re.S)
    repaid = {name: re.findall(r"<td[^>]*>([^<]*)</td>", rest) for name, rest in cells}
    column = re.findall(r"<th>([^<]+)</th>", table).index("break_even_steps") - 1
    assert repaid["cpu fp32 compiled"][column] == "never" and repaid["cpu bf16 compiled"][column] == "-"
    assert repaid["cpu fp32 eager"][column] == "—"
    assert dict(labels)["peak_mem_bytes"] == "GiB the process held at its peak (on a CPU: it only grows, row by row)"


def test_the_memory_chart_of_an_isolated_bench_says_each_row_is_its_own_process_not_that_memory_grows(monkeypatch):
    # Under --isolate each row's CPU memory is its own process's: the page said it "only grows, row by row", as one
    # process's peak does, where the terminal's table says each row's own process
    from redline.render import html

    labels = []
    real = html._bars

    def drawn(rows, key, **options):
        labels.append((key, options["xlabel"]))
        return real(rows, key, **options)

    monkeypatch.setattr(html, "_bars", drawn)
    result = bench_result()
    for row in result["rows"]:
        row["peak_mem_kind"] = "resident"  # a CPU's rows: the process's resident set
    bench_report({**result, "isolated": True})
    told = "GiB the process held at its peak (on a CPU: each row's own process: torch, the data and the row)"
    assert dict(labels)["peak_mem_bytes"] == told
    bench_report(result)
    assert dict(labels)["peak_mem_bytes"].endswith("(on a CPU: it only grows, row by row)")


def test_a_series_of_one_logged_step_is_drawn():
    # A run of --max-steps 1 drew empty axes (a line through one point), alt "over 1 points"
    import io

    import numpy as np
    from matplotlib.image import imread

    from redline.render.plots import Series, line_chart

    chart = line_chart([Series("samples/s", [1.0], [5000.0])], title="Throughput", ylabel="samples/s")
    assert chart.alt == "Throughput: samples/s over 1 point, last 5,000"
    pixels = imread(io.BytesIO(chart.png), format="png")[..., :3]
    blue = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=-1) < 0.1  # matplotlib's first colour
    assert blue.sum() > 20, "the point is marked"


def test_the_step_axis_ticks_whole_steps_around_a_single_one():
    # One logged step was ticked 0.96, 0.98, 1.00, 1.02, 1.04; a longer run at 2.5 and 7.5
    from matplotlib.figure import Figure

    from redline.render.plots import step_axis

    for steps in ({1.0}, {1.0, 2.0, 3.0}, {50.0, 100.0}):
        ax = Figure().add_subplot()
        ax.plot(sorted(steps), [1.0] * len(steps), marker="o")
        step_axis(ax, steps)
        ticks = [tick for tick in ax.get_xticks() if ax.get_xlim()[0] <= tick <= ax.get_xlim()[1]]
        assert ticks and all(float(tick).is_integer() for tick in ticks), (steps, ticks)
        assert min(steps) in ticks or len(steps) > 1


def test_write_report_refuses_a_file_that_is_no_page_or_a_page_redline_did_not_make(tmp_path):
    # The documented way to write a bench page from Python replaced any file there, while the CLI refused it
    notes, mine = tmp_path / "notes.txt", tmp_path / "mine.html"
    notes.write_text("precious")
    mine.write_text("<p>mine</p>")
    with pytest.raises(ConfigError, match="is a file that is no page"):
        write_report(notes, "<html></html>")
    with pytest.raises(ConfigError, match="is a page redline did not make") as refused:
        write_report(mine, "<html></html>")
    assert f"hint: name another file, e.g. {tmp_path / 'mine-report.html'}, or" in str(refused.value), "no --html"
    assert (notes.read_text(), mine.read_text()) == ("precious", "<p>mine</p>")
    ours = write_report(tmp_path / "bench.html", bench_report(bench_result()))
    again = write_report(ours, bench_report(bench_result()))
    assert again == ours, "a page of redline's is replaced, as a new report should"


def test_a_trial_redlines_cache_served_and_an_fp32_row_run_in_tf32_say_so_in_the_table():
    result = bench_result()
    auto = result["rows"][-1]
    auto.update(trial_s=0.01, trial_cached=True, precision="fp32", plan={**auto["plan"], "tf32": {"value": True}})
    table = bench_report(result).split("<h2>Every configuration</h2>", 1)[1]
    assert '<td class="num">0.01 (cached)</td>' in table and "<th>trial_cached</th>" not in table
    assert "trial_s (cached): redline&#x27;s trial cache" in table
    assert "<td>fp32 (TF32)</td>" in table and "fp32 (TF32): the row&#x27;s fp32 matmuls ran in TF32" in table
