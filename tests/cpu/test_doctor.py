"""`redline doctor` on this machine: real probes, the command line, and a child process that hangs or dies."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import redline
from devices import CUDA_SPY
from redline.cli.doctor import doctor as doctor_command
from redline.doctor import DoctorReport, judge, load_snapshot, probes, take_snapshot
from redline.errors import ConfigError

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"
# The command alone, so these tests do not depend on the other commands importing; `python -m redline doctor`
# below goes through the real entry point.
app = typer.Typer()
app.command("doctor")(doctor_command)
app.command("unused")(lambda: None)  # with two commands, typer keeps the command name on the command line
GPU_CHECKS = ["cuda-available", "driver-runtime-compat", "gpu-arch-supported", "cudnn", "nccl", "h2d-bandwidth"]


@pytest.fixture(scope="module")
def full_report() -> tuple[DoctorReport, float]:
    start = time.perf_counter()
    report = redline.doctor.check_machine()
    return report, time.perf_counter() - start


def test_doctor_passes_here_skips_gpu_checks_and_measures_the_cpu(full_report):
    report, seconds = full_report
    assert report.exit_code == 0, [c for c in report.checks if c.status == "fail"]
    assert seconds < 15
    statuses = {c.id: c for c in report.checks}
    if statuses["nvidia-driver"].status == "skip":  # this machine has no GPU
        for check_id in GPU_CHECKS:
            assert statuses[check_id].status == "skip" and statuses[check_id].detail
    assert statuses["device-smoke"].status == "ok" and "cpu correct" in statuses["device-smoke"].detail
    cpu = report.devices[0]
    assert cpu.id == "cpu" and cpu.correct is True and cpu.fp32_tflops and cpu.fp32_tflops > 0
    assert report.versions["torch"] and report.versions["python"] == ".".join(map(str, sys.version_info[:3]))


def test_json_quick_save_probe_and_probe_file_give_the_same_checks(tmp_path):
    runner = CliRunner()
    saved = tmp_path / "snapshot.json"
    first = runner.invoke(app, ["doctor", "--json", "--quick", "--save-probe", str(saved)])
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert set(report) == {"checks", "devices", "versions"}
    assert set(report["checks"][0]) == {"id", "status", "detail", "fix"}
    assert {c["id"]: c["status"] for c in report["checks"]}["device-smoke"] == "skip"  # --quick measures nothing
    quick = load_snapshot(saved)
    assert quick.quick is True and quick.child is None and quick.measurements == []  # no child process ran
    assert quick.torch is not None and quick.torch.imported is False and quick.torch.version
    second = runner.invoke(app, ["doctor", "--json", "--probe-file", str(saved)])
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout) == report


def test_the_saved_snapshots_path_is_said_on_one_line_in_a_log(tmp_path, monkeypatch):
    """Before, stderr in a pipe broke the line at 80 columns, and the path with it."""
    monkeypatch.delenv("COLUMNS", raising=False)
    saved = tmp_path / "a-folder-whose-name-takes-the-line-past-eighty-columns" / "snapshot.json"
    result = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--save-probe", str(saved)])
    assert result.exit_code == 0, result.output
    assert f"snapshot written to {saved}: attach it to your bug report\n" in result.stderr, result.stderr


def test_a_broken_snapshot_prints_the_fix_and_exits_1():
    result = CliRunner().invoke(app, ["doctor", "--probe-file", str(FIXTURES / "shm-64mb-docker.json")])
    assert result.exit_code == 1
    for text in ("redline doctor", "shm-size", "fail", "fix:", "--ipc=host", "Devices", "H100"):
        assert text in result.stdout


def test_a_snapshot_file_cut_down_is_refused_naming_what_it_lacks(tmp_path):
    # Half a saved snapshot was judged: "not macOS (unknown OS)", a failed device smoke check and CUDA advice.
    from redline.doctor.snapshot import Snapshot, load_snapshot

    whole = Snapshot().to_dict()
    (tmp_path / "whole.json").write_text(json.dumps(whole))
    assert load_snapshot(tmp_path / "whole.json") == Snapshot()
    older = {k: v for k, v in whole.items() if k not in ("amd", "infiniband")}  # format 1 before they were read
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert load_snapshot(tmp_path / "older.json").amd is None
    cut = {k: v for k, v in whole.items() if k not in ("system", "python", "torch")}
    (tmp_path / "cut.json").write_text(json.dumps(cut))
    with pytest.raises(ConfigError) as refused:
        load_snapshot(tmp_path / "cut.json")
    assert str(refused.value).startswith(f"{tmp_path / 'cut.json'}: snapshot lacks the field(s) system, python, torch,")
    assert "hint: the file was edited by hand" in str(refused.value)


def test_bad_arguments_and_bad_files_exit_2_with_one_clear_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format_version": 1, "driver": {"gpus": "many"}}))
    result = subprocess.run(
        [sys.executable, "-m", "redline", "doctor", "--probe-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "driver.gpus" in result.stderr and "Traceback" not in result.stderr
    combined = CliRunner().invoke(app, ["doctor", "--quick", "--probe-file", str(bad)])
    assert combined.exit_code != 0 and "no effect with --probe-file" in str(combined.exception)
    saving = CliRunner().invoke(app, ["doctor", "--probe-file", str(bad), "--save-probe", str(tmp_path / "s.json")])
    assert f"--save-probe={str(tmp_path / 's.json')!r} is not allowed" in str(saving.exception)


def test_a_save_probe_path_that_cannot_be_written_is_refused_before_the_probes_run(tmp_path, monkeypatch):
    def no_probe(**kwargs):
        raise AssertionError("the machine was probed, and its snapshot would be lost when the file cannot be written")

    def read_only(*args, **kwargs):  # what creating a file in a read-only directory raises (root would pass)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("redline.cli.doctor.take_snapshot", no_probe)
    with pytest.raises(ConfigError, match=r"not a directory\nhint: e\.g\. --save-probe .*probe\.json"):
        doctor_command(save_probe=tmp_path)
    (tmp_path / "afile").write_text("")
    with pytest.raises(
        ConfigError, match=r"a file you can write\nhint: .*afile is a file, not a directory: pass a path"
    ):
        doctor_command(save_probe=tmp_path / "afile" / "probe.json")  # a file where its directory would be
    monkeypatch.setattr("redline.atomic._temporary_beside", read_only)
    with pytest.raises(ConfigError, match=r"a file you can write\nhint: Permission denied: pass a path"):
        doctor_command(save_probe=tmp_path / "probe.json")


def test_a_save_probe_path_in_a_missing_directory_creates_it(tmp_path):
    saved = tmp_path / "reports" / "today" / "probe.json"  # as `train --out` and `bench --html` create theirs
    result = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--save-probe", str(saved)])
    assert result.exit_code == 0, result.output
    assert load_snapshot(saved).quick is True


HANGING_CHILD = """
import json, time
print("@redline-doctor " + json.dumps({"stage": "import", "status": "begin"}), flush=True)
print("@redline-doctor " + json.dumps({"stage": "import", "status": "done", "facts": {"version": "2.7.1+cu128",
      "cuda": "12.8", "arch_list": ["sm_90"], "num_threads": 2}}), flush=True)
print("@redline-doctor " + json.dumps({"stage": "cuda", "status": "begin"}), flush=True)
time.sleep(600)
"""


def test_a_hung_cuda_call_becomes_a_failed_check_not_a_hang(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANGING_CHILD)
    start = time.perf_counter()
    snapshot = take_snapshot(child_timeout_s=2, child_script=script)
    assert time.perf_counter() - start < 30
    assert snapshot.child is not None and snapshot.child.timed_out and snapshot.child.unfinished_stage == "cuda"
    check = judge(snapshot).check("cuda-available")
    assert check.status == "fail" and "hung for 2 s in stage 'cuda'" in check.detail
    assert check.fix is not None and "nvidia-smi" in check.fix


def test_a_probe_that_blocks_for_good_is_abandoned_and_its_check_says_so(monkeypatch):
    # Listing an LD_LIBRARY_PATH directory on a stale network mount blocks in the kernel for good.
    stuck = threading.Event()
    monkeypatch.setattr(probes, "library_dirs", lambda _path: stuck.wait() and [])
    monkeypatch.setenv("LD_LIBRARY_PATH", "/mnt/stale-nfs/cuda/lib64")
    try:
        start = time.perf_counter()
        snapshot = take_snapshot(quick=True, probe_timeout_s=0.5)
        assert time.perf_counter() - start < 20
    finally:
        stuck.set()
    assert snapshot.probe_errors["library_path"] == "TimeoutError: no answer within 0.5 s (the library_path probe hung)"
    check = judge(snapshot).check("library-shadowing")
    assert check.status == "warn" and check.detail.startswith("not checked: probing it failed (library_path:")


def test_a_crashing_child_becomes_a_failed_check(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, signal\n"
        'print(\'@redline-doctor {"stage": "import", "status": "begin"}\', flush=True)\n'
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    report = judge(take_snapshot(child_script=script))
    check = report.check("torch-build")
    assert check.status == "fail" and "killed by SIGKILL in stage 'import'" in check.detail and check.fix
    assert report.exit_code == 1


def test_a_child_that_writes_bytes_that_are_not_utf8_keeps_its_report(tmp_path):
    """One byte of another encoding (a library's message in Latin-1) lost the whole torch report to a decode error."""
    script = tmp_path / "latin1.py"
    script.write_text(
        "import sys\n"
        "sys.stderr.buffer.write(b'caf\\xe9\\n'); sys.stderr.flush()\n"
        'print(\'@redline-doctor {"stage": "import", "status": "begin"}\', flush=True)\n'
        "sys.exit(3)\n"
    )
    report = judge(take_snapshot(child_script=script))
    check = report.check("torch-build")
    assert check.status == "fail" and "exited with code 3 in stage 'import': caf\ufffd" in check.detail, check.detail
    assert "UnicodeDecodeError" not in check.detail


def test_the_python_api_names_its_own_argument_for_a_snapshot_it_cannot_read(tmp_path):
    from redline.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^probe_file='.*missing.json' is not allowed; expected a readable file"):
        redline.doctor.check_machine(probe_file=tmp_path / "missing.json")


NO_CUDA_IN_PARENT = (
    CUDA_SPY
    + """
import redline
report = redline.doctor.check_machine()
saved = redline.doctor.check_machine(probe_file=sys.argv[1])
print(json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(),
                  "types": [type(report).__name__, type(saved).__name__], "exit": saved.exit_code}))
"""
)


def test_the_doctor_never_starts_cuda_in_its_own_process():
    out = subprocess.run(
        [sys.executable, "-c", NO_CUDA_IN_PARENT, str(FIXTURES / "driver-too-old.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"calls": [], "initialized": False, "types": ["DoctorReport", "DoctorReport"], "exit": 1}


def test_a_save_probe_path_holding_another_file_is_refused_and_kept_an_earlier_snapshot_replaced(tmp_path, monkeypatch):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    script = tmp_path / "train.py"
    script.write_text('print("format_version")\n')
    monkeypatch.setattr("redline.cli.doctor.take_snapshot", lambda **kwargs: pytest.fail("probed before refusing"))
    for kept in (weights, script):
        before = kept.read_bytes()
        with pytest.raises(ConfigError, match=r"an earlier snapshot of --save-probe to replace; this one holds some"):
            doctor_command(save_probe=kept)
        assert kept.read_bytes() == before
    result = CliRunner().invoke(app, ["doctor", "--save-probe", str(script)])
    assert f"hint: name another file, e.g. --save-probe={str(tmp_path / 'probe.json')!r}" in str(result.exception)
    monkeypatch.undo()
    saved = tmp_path / "probe.json"
    for _ in range(2):  # the second run replaces the first one's snapshot
        result = CliRunner().invoke(app, ["doctor", "--json", "--quick", "--save-probe", str(saved)])
        assert result.exit_code == 0, result.output
    assert load_snapshot(saved).quick is True
