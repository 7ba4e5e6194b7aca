"""`redline report` on a run the Trainer wrote: the page shows what the run logged, the command says where it went."""

import pytest

import redline
from report_samples import images, train_digits

pytest.importorskip("matplotlib", reason="the report's charts need the report extra: pip install 'redline[report]'")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    return out, train_digits(out)


def test_the_report_of_a_real_run_shows_its_steps_evaluations_and_plan(run):
    out, summary = run
    written = redline.report(out)
    assert written == out / "report.html"
    doc = written.read_text(encoding="utf-8")
    alts = [image["alt"] for image in images(doc)]
    assert [alt.split(":")[0] for alt in alts] == ["Loss", "Throughput", "Memory", "Step time"]
    evaluations = summary["steps"] // 8 + (summary["steps"] % 8 != 0)  # every 8 steps and at the end
    assert f"train loss over {summary['steps']} points" in alts[0]
    assert f"val loss over {evaluations} points" in alts[0]
    assert f"{summary['steps']} steps, final loss {summary['final_loss']:.4g} (mean of the last steps)" in doc
    for axis in summary["plan"]:
        assert f"<tr><td>{axis}</td>" in doc, axis
    assert summary["plan"]["precision"]["reason"].split(":")[0] in doc


def test_the_command_writes_the_page_and_prints_its_path(run, tmp_path, redline_here):
    out, _ = run
    (out / "report.html").unlink(missing_ok=True)
    result = redline_here("report", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "report.html") and (out / "report.html").is_file()
    elsewhere = tmp_path / "digits.html"
    result = redline_here("report", str(out), "--html", str(elsewhere))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(elsewhere) and elsewhere.read_text().startswith("<!DOCTYPE html>")


def test_the_command_on_a_missing_run_exits_2_with_the_fix(tmp_path, redline_here):
    result = redline_here("report", str(tmp_path / "nothing-here"))
    assert result.returncode == 2 and result.stdout == ""
    assert f"error: run directory '{tmp_path / 'nothing-here'}' does not exist" in result.stderr
    assert "hint: pass the directory a run wrote with --out" in result.stderr
    assert "Traceback" not in result.stderr
