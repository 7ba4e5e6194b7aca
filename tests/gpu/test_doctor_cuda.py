"""`redline doctor` on a machine with a CUDA GPU: every GPU found, started, checked and measured."""

import pytest
import torch

import redline

pytestmark = pytest.mark.gpu


def test_doctor_starts_checks_and_measures_every_gpu():
    report = redline.doctor.check_machine()
    statuses = {c.id: c.status for c in report.checks}
    for check_id in ("nvidia-driver", "torch-build", "cuda-available", "gpu-arch-supported", "device-smoke"):
        assert statuses[check_id] == "ok", report.check(check_id)
    assert statuses["driver-runtime-compat"] in ("ok", "warn")
    gpus = [d for d in report.devices if d.id.startswith("cuda:")]
    assert len(gpus) == torch.cuda.device_count()
    for gpu in gpus:
        assert gpu.correct is True and gpu.fp32_tflops and gpu.lowp_tflops and gpu.lowp_tflops > gpu.fp32_tflops
        assert gpu.h2d_pinned_gbps and gpu.h2d_pageable_gbps
    assert report.versions["driver"] and report.versions["cuda_runtime"] == torch.version.cuda
