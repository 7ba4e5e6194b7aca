"""CUDA_VISIBLE_DEVICES is read as torch's _parse_visible_devices reads it (torch/cuda/__init__.py), which keeps to
CUDA: a list of one kind, index entries read by their leading number, and a GPU listed twice hiding every GPU."""

from pathlib import Path

import pytest

from redline.doctor import judge, load_snapshot
from redline.doctor.checks.visible import hides_every_gpu, leading_index, read_visible
from redline.doctor.snapshot import GpuFacts

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"

GPUS = [GpuFacts(index=i, name="A100", uuid=f"GPU-{i}aaa-bbb") for i in range(4)]


@pytest.mark.parametrize(
    ("value", "visible"),
    [
        ("0,1,0", []),  # a repeat hides every GPU, wherever it stands
        ("1,0,1", []),
        ("0,9,0", []),  # read before the GPUs are looked for: the repeat counts though 9 stops CUDA first
        ("0,-1,0", ["0"]),  # -1 ends the reading before the repeat
        ("0a", ["0"]),  # strtoul: the leading number
        ("+1", ["1"]),
        ("1gpu2,2ampere", ["1", "2"]),  # torch's own example
        (" 2 , 3", ["2", "3"]),
        ("+", []),
        ("GPU-1aaa,GPU-1a", []),  # two prefixes of one GPU
        ("GPU-1aaa,GPU-1aaa", []),
        ("GPU-1aaa,2", ["1"]),  # one kind per list: an index in a list of UUIDs ends it
        ("2,GPU-1aaa", ["2"]),
        ("MIG-5c3e,MIG-5c3e", []),
    ],
)
def test_cuda_visible_devices_reads_as_torch_reads_it(value, visible):
    assert read_visible(value, GPUS).visible == visible
    assert hides_every_gpu(value, GPUS) == (visible == [])


def test_an_index_is_its_leading_number_as_strtoul_reads_it():
    read = {text: leading_index(text) for text in ("7", "07", "+3", "3x", " 4 ", "-0", "-1", "x3", "", "+", "٣")}
    # "٣", an Arabic-Indic digit: Python's isdigit takes it, C's strtoul does not
    assert read == {"7": 7, "07": 7, "+3": 3, "3x": 3, " 4 ": 4, "-0": 0} | dict.fromkeys(("-1", "x3", "", "+", "٣"))


def test_a_repeated_gpu_hides_them_all_whatever_gpus_the_driver_lists():
    """With no GPU listed (NVML unread) a repeat still hides every GPU; a list of real-looking indices may not."""
    assert hides_every_gpu("0,0", []) and hides_every_gpu("abc", []) and not hides_every_gpu("0,1", [])


def test_a_repeated_entry_fails_and_cuda_available_is_sent_to_it():
    """'0,1,0' was a warning ('lists 0 twice') and cuda-available said reinstall the driver: CUDA sees no GPU."""
    report = judge(load_snapshot(FIXTURES / "visible-devices-repeated.json"))
    check = report.check("visible-devices")
    assert check.status == "fail" and "CUDA sees no GPU" in check.detail, check
    assert check.fix == "export CUDA_VISIBLE_DEVICES=0,1"
    cuda = report.check("cuda-available")
    assert cuda.status == "fail" and "CUDA_VISIBLE_DEVICES" in (cuda.fix or "") and "driver" not in (cuda.fix or "")


@pytest.mark.parametrize(("value", "read"), [("0a", "'0a' as 0"), ("+1", "'+1' as 1")])
def test_an_index_with_trailing_text_is_the_gpu_its_number_names(value, read):
    """'0a' and '+1' failed as 'CUDA sees no GPU', where CUDA shows GPU 0 and GPU 1."""
    snap = load_snapshot(FIXTURES / "visible-devices-repeated.json")
    snap.env["CUDA_VISIBLE_DEVICES"] = value
    snap.torch = None
    check = judge(snap).check("visible-devices")
    assert check.status == "ok" and f"(CUDA reads {read})" in check.detail, check


def test_an_entry_of_the_other_kind_ends_the_list_and_the_fix_keeps_one_kind():
    snap = load_snapshot(FIXTURES / "visible-devices-repeated.json")
    uuid = snap.driver.gpus[3].uuid
    snap.env["CUDA_VISIBLE_DEVICES"] = f"{uuid},1"
    check = judge(snap).check("visible-devices")
    assert check.status == "fail" and "'1' names a GPU, but as an index in a list of UUIDs" in check.detail, check
    assert check.fix == f"export CUDA_VISIBLE_DEVICES={uuid},{snap.driver.gpus[1].uuid}"
    snap.env["CUDA_VISIBLE_DEVICES"] = f"1,{uuid[:12]}"
    check = judge(snap).check("visible-devices")
    assert (
        check.status == "fail" and "CUDA sees only 1" in check.detail and check.fix == "export CUDA_VISIBLE_DEVICES=1,3"
    )
