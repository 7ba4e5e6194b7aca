"""The wheel a fix offers: one the driver starts comes before a driver upgrade, minor-version compatibility said."""

from pathlib import Path

from redline.doctor import judge, load_snapshot

FIXTURES = Path(__file__).parent.parent / "fixtures" / "doctor"


def test_a_driver_too_old_for_the_wheel_is_offered_a_wheel_it_starts_before_an_upgrade():
    """driver-too-old (A100s, driver 550, torch cu130) was told only to upgrade the driver to 580, where the cu126
    wheel starts on 550 in CUDA 12's minor-version compatibility."""
    fix = judge(load_snapshot(FIXTURES / "driver-too-old.json")).check("driver-runtime-compat").fix or ""
    assert fix.startswith("keep the driver and install a wheel it starts: pip install --force-reinstall torch==2.9.0 ")
    assert "whl/cu126" in fix and "minor-version compatibility" in fix
    assert fix.index("whl/cu126") < fix.index("upgrade the NVIDIA driver to 580.65.06")


def test_a_gpu_only_newer_wheels_cover_is_offered_the_one_its_driver_starts():
    """An RTX 5090 (sm_120, cu128 and newer) on driver 570.133 (CUDA 12.8) with a CPU wheel whose channels are cu126,
    cu129 and cu13x: cu129 runs on 570, where the fix asked for 575 first."""
    fix = judge(load_snapshot(FIXTURES / "cpu-wheel-on-rtx5090-driver-570.json")).check("torch-build").fix or ""
    assert fix.startswith("pip install --force-reinstall torch==2.13.0 torchvision --index-url ")
    assert (
        fix.split(",")[0].endswith("whl/cu129") and "to run it in full, upgrade the NVIDIA driver to 575.51.03" in fix
    )


def test_a_wheel_the_driver_already_starts_is_not_traded_for_another_it_starts_the_same_way():
    """cu128 on driver 550 runs in minor-version compatibility: a cu126 wheel would too, so only the upgrade helps."""
    check = judge(load_snapshot(FIXTURES / "driver-minor-version-compat.json")).check("driver-runtime-compat")
    assert check.status == "warn" and check.fix is not None and check.fix.startswith("upgrade the NVIDIA driver")
    assert "pip install" not in check.fix


def test_a_driver_below_every_floor_is_only_asked_to_upgrade():
    snap = load_snapshot(FIXTURES / "driver-too-old.json")
    snap.driver.version = snap.driver.kernel_module_version = "520.61.05"  # CUDA 11.8: below CUDA 12's floor
    snap.driver.cuda_version = "11.8"
    fix = judge(snap).check("driver-runtime-compat").fix or ""
    assert fix.startswith("upgrade the NVIDIA driver to 580.65.06") and "pip install" not in fix
