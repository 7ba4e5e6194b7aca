"""Checks of what the devices computed: a correct, reasonably fast matmul on each, and host-to-device copies."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

from redline.doctor.checks.machine import Machine, device_ranges, first_line, mentions, span
from redline.doctor.report import Check, fail, ok, skip, warn
from redline.doctor.snapshot import Measurement

MAX_REL_ERR = 1e-2  # float32 with 256-term sums errs near 1e-6; TF32 near 1e-3; a broken device near 1
PEER_SHARE = 0.7  # a device below this share of its fastest identical peer is throttled or badly linked
# Below a PCIe 3.0 x8 link (7.9 GB/s raw): a link trained down, a narrow slot, or WSL's pinned-memory limits.
PINNED_SLOW_GBPS = 5.0
WRONG_RESULT_FIX = (
    "look for ECC and Xid errors (`nvidia-smi -q -d ECC`, `sudo dmesg | grep -i xid`) and keep work off this "
    "device until it is reset (`sudo nvidia-smi -r -i N`) or replaced"
)
SLOW_LINK_FIX = (
    "check the link under load with `nvidia-smi -q -d PCI` (current vs maximum generation and width); "
    "reseat the GPU or move it to an x16 slot"
)


def expected_devices(m: Machine) -> list[str]:
    facts = m.torch
    if facts is None:
        return []
    cuda = [f"cuda:{d.index}" for d in facts.devices] if facts.cuda_available else []
    return ["cpu", *cuda, *(["mps"] if facts.mps_available else [])]


def describe(results: list[Measurement]) -> str:
    """Summarise correct results per kind of device: "cuda:0-7 correct (fp32 50.9-51.2, bf16 718 TFLOP/s)"."""
    parts = []
    for kind in dict.fromkeys(r.device.partition(":")[0] for r in results):
        group = [r for r in results if r.device.partition(":")[0] == kind]
        fp32 = [r.fp32_tflops for r in group if r.fp32_tflops]
        lowp = [r.lowp_tflops for r in group if r.lowp_tflops]
        figures = ([f"fp32 {flops(fp32)}"] if fp32 else []) + ([f"{group[0].lowp_dtype} {flops(lowp)}"] if lowp else [])
        shown = f" ({', '.join(figures)})" if figures else ""
        parts.append(f"{device_ranges([r.device for r in group])} correct{shown}")
    return "; ".join(parts)


def device_smoke(m: Machine) -> Check:
    if m.snap.quick:
        return skip("device-smoke", "--quick: nothing measured")
    if m.torch is None:
        return skip("device-smoke", "torch did not import (see torch-build)")
    results = {r.device: r for r in m.snap.measurements}
    failures, fixes, passed = [], [], []
    for device in dict.fromkeys([*expected_devices(m), *results]):
        result = results.get(device)
        if result is None:
            failures.append(f"{device} not measured: the child process {m.child_failure()}")
            fixes.append(m.child_fix())
        elif result.error:
            failures.append(f"{device} failed: {first_line(result.error)}")
            fixes.append(error_fix(m, device, result.error))
        elif result.max_rel_err is None or not result.max_rel_err <= MAX_REL_ERR:
            failures.append(f"{device} computed a wrong matmul (error {result.max_rel_err} of the largest value)")
            fixes.append(WRONG_RESULT_FIX)
        else:
            passed.append(result)
    if failures:
        detail = "; ".join(failures + ([describe(passed)] if passed else []))
        return fail("device-smoke", detail, "; ".join(dict.fromkeys(fixes)))
    if not passed:
        return skip("device-smoke", "no device was measured")
    slow = lagging(m, passed, lambda r: r.lowp_tflops or r.fp32_tflops)
    detail = describe(passed)
    if slow:
        return warn(
            "device-smoke",
            f"{detail}; {', '.join(slow)} slower than {PEER_SHARE:.0%} of an identical GPU",
            "look for throttling: `nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE,POWER`",
        )
    return ok("device-smoke", detail)


def flops(tflops: list[float]) -> str:
    """Show matmul speeds in TFLOP/s, or in GFLOP/s below one TFLOP/s (a CPU)."""
    if max(tflops) < 1:
        return f"{span([t * 1000 for t in tflops])} GFLOP/s"
    return f"{span(tflops)} TFLOP/s"


def error_fix(m: Machine, device: str, error: str) -> str:
    if (setting := m.setting_fix(error)) is not None:  # PYTORCH_CUDA_ALLOC_CONF is read at the first allocation
        return setting
    if mentions(error, "no kernel image"):
        return m.wheel_fix()
    if mentions(error, "invalid device function") and m.build == "rocm":
        return "the ROCm wheel has no kernels for this GPU's target: gpu-arch-supported says how to run it"
    if mentions(error, "out of memory"):
        return "other processes hold the GPU memory: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv`"
    return f"see the whole error: python -c \"import torch; x = torch.ones(8, 8, device='{device}'); print(x @ x)\""


def lagging(m: Machine, results: list[Measurement], figure: Callable[[Measurement], float | None]) -> list[str]:
    """Return the CUDA devices whose figure is below PEER_SHARE of the best GPU of the same name."""
    names = {f"cuda:{d.index}": d.name for d in (m.torch.devices if m.torch else [])}
    groups: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for result in results:
        value = figure(result)
        if result.device in names and isinstance(value, float) and math.isfinite(value):
            groups[names[result.device]].append((result.device, value))
    return [
        device for group in groups.values() for device, value in group if value < PEER_SHARE * max(v for _, v in group)
    ]


def h2d_bandwidth(m: Machine) -> Check:
    if m.snap.quick:
        return skip("h2d-bandwidth", "--quick: nothing measured")
    rates = [
        r for r in m.snap.measurements if r.device.startswith("cuda:") and r.h2d_pinned_gbps and r.h2d_pageable_gbps
    ]
    if not rates:
        return skip("h2d-bandwidth", "no CUDA device measured")
    pageable = [r.h2d_pageable_gbps or 0.0 for r in rates]
    pinned = [r.h2d_pinned_gbps or 0.0 for r in rates]
    detail = f"{device_ranges([r.device for r in rates])} pageable {span(pageable)} GB/s, pinned {span(pinned)} GB/s"
    slow = [
        f"{r.device} ({r.h2d_pinned_gbps:.1f} GB/s)" for r in rates if (r.h2d_pinned_gbps or 0.0) < PINNED_SLOW_GBPS
    ]
    if slow:
        return warn(
            "h2d-bandwidth", f"{detail}: {', '.join(slow)} below {PINNED_SLOW_GBPS:g} GB/s pinned", SLOW_LINK_FIX
        )
    behind = lagging(m, rates, lambda r: r.h2d_pinned_gbps)
    if behind:
        return warn("h2d-bandwidth", f"{detail}: {', '.join(behind)} slower than an identical GPU", SLOW_LINK_FIX)
    gain = min(b / a for a, b in zip(pageable, pinned, strict=True))
    advice = (
        "pin host memory (DataLoader pin_memory=True; redline's Runtime does)"
        if gain >= 1.2
        else "pinning gains little"
    )
    return ok("h2d-bandwidth", f"{detail}; pinned is {gain:.1f}x pageable or better: {advice}")
