"""The compatibility rules the doctor applies: driver per CUDA, kernels per GPU, wheel channel, companions."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from redline.doctor.checks.libraries import cudnn_text, soname_of
from redline.doctor.checks.machine import device_ranges, span
from redline.doctor.checks.visible import read_visible
from redline.doctor.compat import (
    arch_support,
    best_channel,
    companion_version,
    compatible_channel,
    driver_cuda,
    install_torch,
    local_tag,
    min_driver,
    parse_version,
    runs_on,
    tag_cuda,
)
from redline.doctor.snapshot import GpuFacts


@pytest.mark.parametrize(
    ("text", "version"),
    [("2.4.0+cu121", (2, 4, 0)), ("570.124.06", (570, 124, 6)), ("12.8", (12, 8)), ("v3.11", (3, 11)), ("x", None)],
)
def test_versions_parse_their_leading_numbers(text, version):
    assert parse_version(text) == version


def test_build_tags_name_the_cuda_they_carry():
    assert local_tag("2.4.0+cu121") == "cu121" and local_tag("2.13.0+cpu") == "cpu" and local_tag("2.7.1") is None
    assert tag_cuda("cu121") == (12, 1) and tag_cuda("cu130") == (13, 0) and tag_cuda("cu118") == (11, 8)
    assert tag_cuda("cpu") is None and tag_cuda("rocm6.2") is None


def test_minimum_driver_follows_nvidia_table_3():
    assert min_driver((12, 8)) == "570.26" and min_driver((12, 8), windows=True) == "570.65"
    assert min_driver((12, 7)) == "560.28.03"  # no 12.7 release: the nearest older minor of the same major
    assert min_driver((13, 0)) == "580.65.06" and min_driver((13, 0), windows=True) is None
    assert min_driver((10, 2)) is None
    assert driver_cuda("550.54.15") == (12, 4) and driver_cuda("570.124.06") == (12, 8)
    assert driver_cuda("580.95.05") == (13, 0) and driver_cuda("440.33") is None and driver_cuda("junk") is None


def test_kernels_run_on_the_same_major_with_a_newer_minor_except_jetson_parts():
    assert runs_on(80, 86) and runs_on(80, 89) and not runs_on(80, 90) and not runs_on(86, 80)
    assert not runs_on(80, 87)  # Orin is excluded from the sm_80 family
    assert runs_on(87, 87) and runs_on(101, 110) and not runs_on(100, 101)
    assert arch_support(90, ["sm_80", "sm_90"]) == "native"
    assert arch_support(120, ["sm_90", "compute_90"]) == "ptx"  # PTX JIT-compiles forward
    assert arch_support(120, ["sm_50", "sm_90"]) is None
    assert arch_support(60, ["sm_75", "sm_80", "compute_120"]) is None
    assert arch_support(90, ["sm_90a", "bogus"]) == "native"


CHANNELS = {"12.6": [50, 60, 70, 75, 80, 86, 90], "12.8": [70, 75, 80, 86, 90, 100, 120], "13.0": [75, 80, 90, 120]}


def test_the_newest_channel_the_driver_runs_that_covers_every_gpu_wins():
    assert best_channel([90], (13, 0), CHANNELS) == "13.0"
    assert best_channel([90], (12, 9), CHANNELS) == "12.8"
    assert best_channel([60], None, CHANNELS) == "12.6"
    assert best_channel([120, 60], None, CHANNELS) is None  # no channel covers both
    assert best_channel([120], (12, 6), CHANNELS) is None  # only newer channels cover sm_120


def test_a_driver_starts_the_oldest_newer_channel_of_a_major_whose_floor_it_meets():
    """Minor-version compatibility: driver 550 (CUDA 12.4) starts CUDA 12.6 and 12.8, never 13.0 (floor 580)."""
    assert compatible_channel([80], "550.54.15", CHANNELS) == "12.6"
    assert compatible_channel([120], "560.35.03", CHANNELS) == "12.8"  # sm_120 needs 12.8 or newer
    assert compatible_channel([120], "520.61.05", CHANNELS) is None  # below CUDA 12's floor, 525.60.13
    assert compatible_channel([80], "580.65.06", {"13.0": [80]}) == "13.0"
    assert compatible_channel([80], "581.57", {"13.0": [80]}, windows=True) is None  # NVIDIA lists no Windows floor
    assert compatible_channel([80], None, CHANNELS) is None


def test_install_commands_pin_torch_where_the_channel_carries_it():
    command = install_torch("2.7.1+cpu", "12.8", ["torchvision"], own_table=False)
    assert command == (
        "pip install --force-reinstall torch==2.7.1 torchvision --index-url https://download.pytorch.org/whl/cu128"
    )
    assert "'torch>=2.7'" in install_torch("2.6.0+cu124", "12.8", [], own_table=False)  # 2.6 was never on cu128
    assert "torch==2.6.0" in install_torch("2.6.0+cu124", "12.8", [], own_table=True)
    assert install_torch("2.10.0.dev20260101+cu130", "13.0", [], own_table=True).startswith("pip install --pre")
    assert install_torch("2.7.1", None, [], own_table=False).endswith("/whl/cpu")


def test_companions_pair_with_their_torch_minor():
    assert companion_version("torchvision", "2.4.0+cu121") == (0, 19)
    assert companion_version("torchaudio", "2.7.1") == (2, 7)
    assert companion_version("torchvision", "1.13.1") is None


def test_cuda_visible_devices_reads_like_cuda():
    gpus = [GpuFacts(index=i, name="A100", uuid=f"GPU-{i}aaa-bbb") for i in range(4)]
    parsed = read_visible("0, 2,-1,1", gpus)
    assert parsed.visible == ["0", "2"] and parsed.stopped_at == "-1" and parsed.valid == ["0", "2", "1"]
    assert read_visible("GPU-3aaa,GPU-1", gpus).visible == ["3", "1"]
    assert read_visible("GPU-,0", gpus).stopped_at == "GPU-"  # a prefix that names several GPUs names none
    assert read_visible("MIG-5c3e,MIG-77", gpus).visible == ["MIG-5c3e", "MIG-77"]


def test_library_versions_and_ranges_read_right():
    assert soname_of("libnvJitLink.so.12.1.105") == ("libnvJitLink.so.12", (12, 1, 105))
    assert soname_of("libcudnn.so.9") == ("libcudnn.so.9", (9,)) and soname_of("libcudnn.so") is None
    assert cudnn_text(90100) == "9.1.0" and cudnn_text(8902) == "8.9.2"
    assert device_ranges(["cuda:0", "cuda:1", "cuda:2"]) == "cuda:0-2"
    assert device_ranges(["cuda:0", "cuda:2", "cuda:3"]) == "cuda:0, cuda:2, cuda:3"
    assert span([51.0, 51.2]) == "51.2" and span([40.0, 51.0]) == "40-51"


@given(st.one_of(st.text(max_size=30), st.text(alphabet="GPU-MI0123,+ a", max_size=30)))
def test_parsers_take_any_text(text):
    parse_version(text)
    tag_cuda(local_tag(text))
    soname_of(text)
    gpus = [GpuFacts(index=0, name="g", uuid="GPU-1"), GpuFacts(index=1, name="g", uuid="GPU-2")]
    parsed = read_visible(text, gpus)
    assert len(parsed.visible) == len(set(parsed.visible)) <= len(parsed.valid)  # each GPU once, each one named
