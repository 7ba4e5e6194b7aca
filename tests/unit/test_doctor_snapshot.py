"""Snapshots round-trip through JSON, refuse what they cannot trust, and take the child's report as facts."""

import json
import os
from pathlib import Path

import pytest

from redline.doctor import check_machine, torch_child
from redline.doctor.child import MARKER, apply_report, parse_lines
from redline.doctor.driver import kernel_module_version, parse_nvidia_smi
from redline.doctor.probes import container_kind, literal_assignments, probe_amd, read_torch_build
from redline.doctor.snapshot import FORMAT_VERSION, AmdFacts, ChildRun, Snapshot, TorchFacts, load_snapshot
from redline.errors import ConfigError

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"


@pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
def test_every_fixture_round_trips(path, tmp_path):
    snapshot = load_snapshot(path)
    snapshot.save(tmp_path / "again.json")
    assert load_snapshot(tmp_path / "again.json") == snapshot
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION


def test_a_partial_snapshot_loads_with_defaults():
    snapshot = Snapshot.from_dict(
        {"env": {"CUDA_VISIBLE_DEVICES": "1"}, "driver": {"gpus": [{"index": 0, "name": "T4"}]}}
    )
    assert snapshot.env == {"CUDA_VISIBLE_DEVICES": "1"} and snapshot.driver.gpus[0].capability is None
    assert snapshot.torch is None and snapshot.shm is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "snapshot=[1, 2] is not allowed; expected a JSON object"),
        ({"format_version": 99}, "upgrade redline"),
        ({"sytem": {}}, "snapshot.sytem="),
        ({"driver": {"gpus": [{"index": 0, "name": "T4", "capability": [7]}]}}, "snapshot.driver.gpus[0].capability"),
        ({"driver": {"gpus": [{"index": "0", "name": "T4"}]}}, "expected an integer"),
        ({"driver": {"gpus": [{"name": "T4"}]}}, "index"),
        ({"driver": {"source": "lspci"}}, "'nvml' or 'nvidia-smi'"),
        ({"shm": {"total_bytes": True}}, "snapshot.shm.total_bytes=True"),
        ({"env": {"A": 1}}, "snapshot.env.A=1"),
    ],
)
def test_a_bad_snapshot_is_refused_with_the_path_of_the_bad_value(data, message):
    with pytest.raises(ConfigError, match=r"re-create it|upgrade redline|fields of") as error:
        Snapshot.from_dict(data)
    assert message in str(error.value)


def test_an_unreadable_probe_file_says_how_to_make_one(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="--save-probe"):
        load_snapshot(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="a readable file"):
        load_snapshot(tmp_path / "missing.json")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00{")  # not UTF-8: a clear error, not a traceback
    with pytest.raises(ConfigError, match="--save-probe"):
        load_snapshot(tmp_path / "binary.json")


CHILD_OUTPUT = """\
some library printed this
@redline-doctor {"stage": "import", "status": "begin"}
@redline-doctor {"stage": "import", "status": "done", "facts": {"version": "2.7.1+cu128", "cuda": "12.8", \
"arch_list": ["sm_90"], "num_threads": 8}, "warnings": []}
@redline-doctor {"stage": "cuda", "status": "begin"}
@redline-doctor {"stage": "cuda", "status": "done", "facts": {"cuda_available": true, "device_count": 1, \
"devices": [{"index": 0, "name": "H100", "capability": [9, 0], "mem_total_gib": 79.1, "sm_count": 132, \
"uuid": "ab"}]}, "warnings": ["w"]}
@redline-doctor {"stage": "cpu", "status": "begin"}
@redline-doctor {"stage": "cpu", "status": "done", "facts": {"device": "cpu", "max_rel_err": 1e-7, "fp32_tflops": 0.2}}
@redline-doctor {"stage": "cuda:0", "status": "begin"}
@redline-doctor {"stage": "cuda:0", "status": "error", "error": "RuntimeError: CUDA error: an illegal memory access"}
@redline-doctor {"stage": "mps", "status": "begin"}
@redline-doctor not json
"""


def test_the_child_report_becomes_torch_facts_and_measurements():
    assert torch_child.MARKER == MARKER  # the child speaks the protocol the parent reads
    report = parse_lines(CHILD_OUTPUT)
    assert report.begun == ["import", "cuda", "cpu", "cuda:0", "mps"]
    snapshot = Snapshot()
    run = ChildRun(exit_code=-11, unfinished_stage="mps")
    apply_report(snapshot, report, run)
    torch = snapshot.torch
    assert torch is not None and torch.version == "2.7.1+cu128" and torch.cuda_available is True
    assert torch.devices[0].capability == (9, 0) and torch.warnings == ["w"]
    assert [(m.device, m.error) for m in snapshot.measurements] == [
        ("cpu", None),
        ("cuda:0", "RuntimeError: CUDA error: an illegal memory access"),
    ]
    assert snapshot.child is run


def test_a_child_that_died_importing_torch_leaves_no_torch_facts():
    snapshot = Snapshot()
    apply_report(snapshot, parse_lines('@redline-doctor {"stage": "import", "status": "begin"}\n'), ChildRun())
    assert snapshot.torch is None
    apply_report(
        snapshot, parse_lines('@redline-doctor {"stage": "import", "status": "error", "error": "E"}'), ChildRun()
    )
    assert snapshot.torch is not None and snapshot.torch.import_error == "E"


def test_nvidia_smi_and_the_kernel_module_version_parse(tmp_path):
    facts = parse_nvidia_smi(
        "0, NVIDIA H200, GPU-5c3e, 9.0, 143771, 00000000:18:00.0, 570.124.06\n"
        "1, Tesla K80, GPU-77aa, [N/A], [N/A], 00000000:19:00.0, 570.124.06\n"
    )
    assert facts.source == "nvidia-smi" and facts.version == "570.124.06"
    assert facts.gpus[0].capability == (9, 0) and facts.gpus[0].mem_total_gib == 140.4
    assert facts.gpus[1].capability is None and facts.gpus[1].mem_total_gib is None
    proc = tmp_path / "version"
    proc.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.124.06  Release Build  (dvs-builder)\n"
    )
    assert kernel_module_version(str(proc)) == "570.124.06"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024\n")
    assert kernel_module_version(str(proc)) == "550.90.07"
    assert kernel_module_version(str(tmp_path / "absent")) is None


def test_quick_reads_the_installed_torchs_version_build_and_channels_from_its_files():
    import torch

    assert read_torch_build() == TorchFacts(
        imported=False,
        version=torch.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        release_channels=torch_child.release_channels(torch),  # what the child reads from the imported torch
    )


def test_only_literal_top_level_assignments_are_read():
    source = (
        "from typing import Optional\n"
        "__version__ = '2.7.1+cu128'\n"
        "cuda: Optional[str] = '12.8'\n"
        "hip = None\n"
        "git_version = compute()\n"
        "a, b = 1, 2\n"
        "def f():\n    inner = 1\n"
    )
    assert literal_assignments(source) == {"__version__": "2.7.1+cu128", "cuda": "12.8", "hip": None}


def test_a_doctor_json_report_passed_as_a_probe_file_is_named_as_such(tmp_path):
    # `redline doctor --json > probe.json` then `--probe-file probe.json`: the report, not the snapshot
    report = tmp_path / "probe.json"
    report.write_text(json.dumps({"checks": [{"id": "python", "status": "ok"}], "devices": [], "versions": {}}))
    with pytest.raises(ConfigError) as error:
        load_snapshot(report)
    assert str(error.value).startswith(f"--probe-file={str(report)!r} is not allowed; expected a snapshot written")
    assert "the report `redline doctor --json` prints" in str(error.value) and "'status'" not in str(error.value)


def test_amds_device_files_are_read_with_this_processs_access(tmp_path, monkeypatch):
    (tmp_path / "dri").mkdir()
    for name in ("kfd", "dri/renderD129", "dri/renderD128", "dri/card0"):
        (tmp_path / name).touch()
    denied = str(tmp_path / "dri/renderD129")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != denied and real_access(path, mode))
    facts = probe_amd(tmp_path)
    nodes = [str(tmp_path / "dri/renderD128"), denied]
    assert facts == AmdFacts(kfd=True, kfd_access=True, render_nodes=nodes, render_access=nodes[:1])
    assert probe_amd(tmp_path / "nothing") == AmdFacts()  # no AMD GPU: no /dev/kfd, no render node


def test_an_apptainer_container_is_named_so_though_it_passes_kubernetes_variables_through(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # the host's, passed through by Apptainer
    monkeypatch.setenv("APPTAINER_CONTAINER", "/scratch/images/train.sif")
    assert container_kind() == "apptainer"
    monkeypatch.delenv("APPTAINER_CONTAINER")
    monkeypatch.setenv("SINGULARITY_CONTAINER", "/scratch/images/train.sif")
    assert container_kind() == "apptainer"


def test_check_machine_refuses_quick_with_a_probe_file_as_the_command_does():
    # A saved snapshot is judged as it was taken: quick would be silently ignored.
    with pytest.raises(ConfigError, match="drop quick"):
        check_machine(quick=True, probe_file=FIXTURES / "healthy-h200.json")
    assert check_machine(probe_file=FIXTURES / "healthy-h200.json").exit_code == 0


def test_check_machine_names_an_argument_of_the_wrong_kind():
    with pytest.raises(ConfigError, match=r"^quick='yes' is not allowed; expected True or False"):
        check_machine(quick="yes")  # type: ignore[arg-type]  # was taken as true
    with pytest.raises(ConfigError, match=r"^probe_file=123 is not allowed; expected a path to a snapshot file"):
        check_machine(probe_file=123)  # type: ignore[arg-type]  # was a raw TypeError
