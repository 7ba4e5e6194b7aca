"""An `import torch` that fails is blamed on what the snapshot shows caused it, not on whatever is set nearby."""

from pathlib import Path

from redline.doctor import judge, load_snapshot

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
