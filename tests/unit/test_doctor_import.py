"""An `import torch` that fails is blamed on what the snapshot shows caused it, not on whatever is set nearby."""

from pathlib import Path

import pytest

from redline.doctor import judge, load_snapshot
from redline.doctor.checks.machine import TORCH_SETTINGS, first_line
from redline.doctor.probes import ENV_VARS

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"


def test_a_missing_library_is_not_blamed_on_an_ld_library_path_that_holds_no_cuda_library():
    """An NVIDIA container sets LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64, the driver's: a
    missing libcudnn.so.9 was answered `unset LD_LIBRARY_PATH`, while library-shadowing said nothing shadows."""
    report = judge(load_snapshot(FIXTURES / "cudnn-missing-in-container.json"))
    build = report.check("torch-build")
    assert build.status == "fail" and "LD_LIBRARY_PATH" not in (build.fix or ""), build
    assert (build.fix or "").startswith("pip install --force-reinstall torch==2.4.0")
    assert report.check("library-shadowing").status == "ok"


def test_an_undefined_symbol_is_blamed_on_ld_library_path_only_where_it_holds_cuda_libraries():
    snap = load_snapshot(FIXTURES / "ld-library-path-import-error.json")
    assert "export LD_LIBRARY_PATH=/opt/tools/lib" in (judge(snap).check("torch-build").fix or "")
    for entry in snap.library_path:  # the same directories, holding no CUDA library
        entry.libs = []
    report = judge(snap)
    assert "LD_LIBRARY_PATH" not in (report.check("torch-build").fix or "")
    assert report.check("library-shadowing").status != "fail"


def test_an_ld_library_path_entry_the_error_names_is_blamed_though_it_holds_no_cuda_library():
    # A libtorch's lib/ hands torch its own libtorch_python.so (pytorch/pytorch#62650): the fix was a reinstall,
    # which the loader would still bypass, and library-shadowing said ok
    snap = load_snapshot(FIXTURES / "ld-library-path-import-error.json")
    snap.library_path = snap.library_path[:1]
    snap.library_path[0].path, snap.library_path[0].libs = "/home/u/libtorch/lib", []
    snap.torch.import_error = (
        "ImportError: /home/u/libtorch/lib/libtorch_python.so: undefined symbol: PyThread_tss_alloc"
    )
    report = judge(snap)
    assert (report.check("torch-build").fix or "").startswith("unset LD_LIBRARY_PATH"), report.check("torch-build")
    assert report.check("library-shadowing").status == "fail"
    assert report.check("library-shadowing").fix == "unset LD_LIBRARY_PATH"


def test_a_torch_setting_torch_refuses_at_import_is_the_fix_not_a_reinstall():
    """TORCH_LOGS=nonsense: the detail was 'import torch failed: ValueError:' and the fix reinstalled torch."""
    check = judge(load_snapshot(FIXTURES / "torch-logs-refused.json")).check("torch-build")
    assert check.status == "fail", check
    assert check.detail.startswith("import torch failed: ValueError: Invalid log settings: dynamo,nonsense, must be")
    assert (check.fix or "").startswith("unset TORCH_LOGS,") and "pip install" not in (check.fix or "")


def test_the_first_line_of_a_message_that_begins_with_a_newline_is_its_type_and_its_reason():
    assert first_line("ValueError: \n\nInvalid log settings: x\nmore") == "ValueError: Invalid log settings: x"
    assert first_line("torch._C.Error:\nbad") == "torch._C.Error: bad"
    assert first_line("ImportError: libx.so: cannot open\nmore") == "ImportError: libx.so: cannot open"
    assert first_line("\n  \n") == "" and first_line(None) == ""


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("TORCH_LOGS_FORMAT", "%(nonsense", "ValueError: Invalid format '%(nonsense' for '%' style"),  # quotes it
        ("TORCH_LOGS_OUT", "/gone/x.log", "FileNotFoundError: [Errno 2] No such file or directory: '/gone/x.log'"),
    ],
)
def test_a_torch_setting_is_blamed_when_the_error_quotes_its_value(name, value, error):
    snap = load_snapshot(FIXTURES / "torch-logs-refused.json")
    snap.env = {name: value, "TORCH_LOGS": "dynamo"}  # a TORCH_LOGS torch accepts, which the error does not name
    snap.torch.import_error = error
    assert (judge(snap).check("torch-build").fix or "").startswith(f"unset {name},")


def test_a_torch_setting_the_error_does_not_name_is_left_alone():
    snap = load_snapshot(FIXTURES / "torch-logs-refused.json")
    snap.env = {"TORCH_LOGS": "dynamo", "TORCH_LOGS_OUT": "/tmp/x.log"}
    snap.torch.import_error = "ImportError: libcudnn.so.9: cannot open shared object file: No such file or directory"
    assert (judge(snap).check("torch-build").fix or "").startswith("pip install --force-reinstall torch==2.13.0")


def test_an_allocator_setting_a_gpu_refuses_is_the_fix_for_the_device():
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segment:True"  # a misspelt key
    gpu = next(result for result in snap.measurements if result.device == "cuda:0")
    gpu.error = "RuntimeError: Unrecognized key 'expandable_segment' in Accelerator allocator config."
    check = judge(snap).check("device-smoke")
    assert check.status == "fail" and (check.fix or "").startswith("unset PYTORCH_CUDA_ALLOC_CONF,"), check


def test_an_out_of_memory_that_recommends_the_allocator_setting_does_not_blame_it():
    # torch's message ends "try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True": the fix said to unset it
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    gpu = next(result for result in snap.measurements if result.device == "cuda:0")
    gpu.error = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
        "139.80 GiB of which 1.2 GiB is free. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    fixes = []
    for value in (None, "expandable_segments:True"):
        if value is not None:
            snap.env["PYTORCH_CUDA_ALLOC_CONF"] = value
        fixes.append(judge(snap).check("device-smoke").fix or "")
    assert fixes[0] == fixes[1] and "unset PYTORCH_CUDA_ALLOC_CONF" not in fixes[1], fixes


def test_every_torch_setting_a_check_blames_is_recorded_in_the_snapshot():
    assert set(TORCH_SETTINGS) <= set(ENV_VARS)


def test_an_allocator_setting_that_stops_cuda_is_the_fix_before_the_driver():
    """torch before 2.9 parses PYTORCH_CUDA_ALLOC_CONF as CUDA starts: the fix said to check nvidia-smi."""
    snap = load_snapshot(FIXTURES / "healthy-h200.json")
    snap.env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size:512"
    snap.torch.cuda_available, snap.torch.devices = False, []
    snap.torch.cuda_error = "RuntimeError: Unrecognized CachingAllocator option: max_split_size"
    check = judge(snap).check("cuda-available")
    assert check.status == "fail" and (check.fix or "").startswith("unset PYTORCH_CUDA_ALLOC_CONF,"), check
