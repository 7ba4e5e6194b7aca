"""The doctor's child process: import torch, start CUDA, measure each device; report stage by stage.

Run by path as ``python torch_child.py``, never imported by redline: it needs only the
standard library and torch, so whatever torch or the driver do here (hang, abort, segfault) cannot
take the doctor's own process down, and the doctor's process never initialises CUDA.

Protocol: each stage prints ``MARKER {"stage": ..., "status": "begin"}`` before it starts and
``MARKER {"stage": ..., "status": "done", "facts": {...}, "warnings": [...]}`` (or ``"error"``)
after, one JSON object per line; other output is ignored. A stage that began and never ended is
where the process hung or died. Stages: ``import``, ``cuda``, ``cpu``, one ``cuda:N`` per CUDA
device, and ``mps``. `redline doctor --quick` does not run this process at all.
"""

from __future__ import annotations

import functools
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "@redline-doctor "
CHECK_SIZE = 256  # matmul checked against float64 on the CPU
CPU_SIZE, GPU_FP32_SIZE, GPU_LOWP_SIZE = 1024, 4096, 8192  # timed matmuls
H2D_BYTES = 128 * 2**20
MIN_TIMED_S = 0.2


def emit(stage: str, status: str, **payload: Any) -> None:
    print(MARKER + json.dumps({"stage": stage, "status": status, **payload}), flush=True)


def run_stage(stage: str, probe: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Run one probe, reporting its start, its facts or its error, and the warnings it raised."""
    emit(stage, "begin")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            facts = probe()
        except BaseException as exc:  # this process exists to report whatever happens
            emit(stage, "error", error=f"{type(exc).__name__}: {exc}", warnings=[str(w.message) for w in caught])
            return None
    emit(stage, "done", facts=facts, warnings=[str(w.message) for w in caught])
    return facts


def build_facts() -> dict[str, Any]:
    import torch

    cuda_build = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    facts: dict[str, Any] = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "arch_list": torch.cuda.get_arch_list() if cuda_build else [],
        "release_channels": release_channels(torch),
        "num_threads": torch.get_num_threads(),
        "mps_built": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_built()),
        "mps_available": bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()),
    }
    if cuda_build:
        try:
            facts["cudnn_version"] = torch.backends.cudnn.version()
        except Exception as exc:  # the version-mismatch RuntimeError is the finding
            facts["cudnn_error"] = f"{type(exc).__name__}: {exc}"
        if hasattr(torch._C, "_nccl_version"):
            facts["nccl_version"] = ".".join(str(part) for part in torch.cuda.nccl.version()[:3])
    return facts


def release_channels(torch: Any) -> dict[str, list[int]] | None:
    """Return torch's own table of wheel channels and their architectures for this host, if it has one."""
    table = getattr(torch.cuda, "PYTORCH_RELEASES_CODE_CC", None)
    if not isinstance(table, dict):
        return None
    host = "aarch64" if platform.machine().lower() in ("aarch64", "arm64") else "x86_64"
    return {cuda: sorted(by_host.get(host, ())) for cuda, by_host in table.items() if isinstance(by_host, dict)}


def cuda_facts() -> dict[str, Any]:
    import torch

    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    devices = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)  # starts CUDA; capability warnings come here
        devices.append(
            {
                "index": index,
                "name": props.name,
                "capability": [props.major, props.minor],
                "mem_total_gib": props.total_memory / 2**30,
                "sm_count": props.multi_processor_count,
                "uuid": str(getattr(props, "uuid", "")),
                # CUDA builds answer gcnArchName with the device's name: the target is ROCm's alone.
                "arch": str(getattr(props, "gcnArchName", "")) if torch.version.hip else "",
            }
        )
    return {"cuda_available": available, "device_count": count, "devices": devices}


def rel_err(got: Any, ref: Any) -> float:
    return float((got.double().cpu() - ref).abs().max() / ref.abs().max())


def matmul_check(torch: Any, device: str) -> float:
    """Return the error of a float32 matmul on ``device`` relative to float64 on the CPU."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(CHECK_SIZE, CHECK_SIZE, generator=gen, dtype=torch.float64) for _ in range(2))
    return rel_err(a.float().to(device) @ b.float().to(device), a @ b)


def matmul_tflops(torch: Any, device: str, dtype: Any, size: int, sync: Callable[[], None]) -> float:
    """Time square matmuls after a warm-up, synchronising before reading the clock."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(2):
        a @ b
    sync()
    iters, start = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
            if (elapsed := time.perf_counter() - start) >= MIN_TIMED_S:
                return 2 * size**3 * iters / elapsed / 1e12


def cpu_facts() -> dict[str, Any]:
    import torch

    return {
        "device": "cpu",
        "max_rel_err": matmul_check(torch, "cpu"),
        "fp32_tflops": matmul_tflops(torch, "cpu", torch.float32, CPU_SIZE, lambda: None),
    }


def cuda_device_facts(index: int) -> dict[str, Any]:
    import torch

    device = f"cuda:{index}"
    torch.backends.cuda.matmul.allow_tf32 = False  # check and time true float32
    torch.backends.cudnn.allow_tf32 = False
    sync = lambda: torch.cuda.synchronize(index)  # noqa: E731
    lowp = torch.bfloat16 if torch.cuda.get_device_capability(index) >= (8, 0) else torch.float16
    facts = {
        "device": device,
        "max_rel_err": matmul_check(torch, device),
        "conv_rel_err": conv_check(torch, device),
        "fp32_tflops": matmul_tflops(torch, device, torch.float32, GPU_FP32_SIZE, sync),
        "lowp_tflops": matmul_tflops(torch, device, lowp, GPU_LOWP_SIZE, sync),
        "lowp_dtype": "bf16" if lowp is torch.bfloat16 else "fp16",
    }
    facts.update(h2d_rates(torch, index))
    torch.cuda.empty_cache()
    return facts


def conv_check(torch: Any, device: str) -> float:
    """Return the error of a cuDNN convolution relative to float64 on the CPU."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 32, 32, generator=gen, dtype=torch.float64)
    w = torch.randn(16, 8, 3, 3, generator=gen, dtype=torch.float64)
    got = torch.nn.functional.conv2d(x.float().to(device), w.float().to(device), padding=1)
    return rel_err(got, torch.nn.functional.conv2d(x, w, padding=1))


def h2d_rates(torch: Any, index: int) -> dict[str, float]:
    """Measure host-to-device copies from pageable and from pinned memory, in GB/s."""
    numel = H2D_BYTES // 4
    dst = torch.empty(numel, device=f"cuda:{index}")
    rates = {}
    for name, pinned in (("h2d_pageable_gbps", False), ("h2d_pinned_gbps", True)):
        src = torch.ones(numel, pin_memory=pinned)
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(index)
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(index)
        rates[name] = 5 * H2D_BYTES / (time.perf_counter() - start) / 1e9
    return rates


def mps_facts() -> dict[str, Any]:
    import torch

    return {
        "device": "mps",
        "max_rel_err": matmul_check(torch, "mps"),
        "fp32_tflops": matmul_tflops(torch, "mps", torch.float32, GPU_FP32_SIZE // 2, torch.mps.synchronize),
    }


def main() -> int:
    # Run by path, Python put this file's folder first on sys.path; its modules must not shadow any torch imports.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    build = run_stage("import", build_facts)
    if build is None:
        return 0
    cuda = run_stage("cuda", cuda_facts) if build["cuda"] or build["hip"] else None
    run_stage("cpu", cpu_facts)
    for device in (cuda or {}).get("devices", []):
        run_stage(f"cuda:{device['index']}", functools.partial(cuda_device_facts, device["index"]))
    if build["mps_available"]:
        run_stage("mps", mps_facts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
