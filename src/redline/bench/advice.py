"""What a profiled step suggests trying: rules over its breakdown and Plan, each naming the flag and the
command that measures it (a profile proposes, a measurement decides)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from redline.bench.trace import Breakdown
from redline.plan import Choice, Plan

DATA_SHARE = 0.10  # loading above this share of a step is worth a look (the old TensorBoard plugin said 5%)
IDLE_SHARE = 0.40  # a GPU idle this long in each step waits on the host
OPTIMIZER_SHARE = 0.30
FUSED_TIMED = re.compile(r"as fused stepped ([\d.]+)x as fast")  # the Plan's row where a timing kept it as given


def advise(
    breakdown: Breakdown, plan: Plan, *, env: Any, anomaly: bool, gpu: bool = False, batch_size: int | None = None,
    graphs: bool = False, fast: Sequence[str] = ("bf16-mixed",), optimizer: str | None = None,
) -> list[str]:  # fmt: skip
    """What to try, by the breakdown's biggest costs; each names its flag and the command that measures it.

    ``gpu``: the step ran on a CUDA GPU (whose kernels the trace should hold). ``batch_size``: the
    profiled one, which a bench of larger ones starts from. ``graphs``: the step ran compiled as CUDA
    graphs (reduce-overhead), which the advice then does not propose again. ``fast``: the reduced
    precisions the device has fast arithmetic for (``fast_precisions``; none on an AVX2 CPU, where bf16
    ran 30x slower). ``optimizer``: how the optimizer stepped ("fused", "foreach", or None: one tensor at a time).
    """
    shares = {p.name: p.share for p in breakdown.phases}
    sizes = f"{batch_size},{2 * batch_size}" if batch_size else "64,128"
    out = []
    if gpu and breakdown.device_busy is None:
        out.append(
            "the trace holds no GPU kernel: the profiler could not record the GPU (CUPTI refused; in a container "
            "it may need --cap-add SYS_ADMIN, on a host the driver option NVreg_RestrictProfilingToAdminUsers=0), "
            "so every time above is the host's"
        )
    if anomaly:
        out.append(
            "autograd anomaly detection is on (torch.autograd.set_detect_anomaly): every backward op is checked "
            "and slowed; turn it off outside debugging"
        )
    if gpu and env.get("CUDA_LAUNCH_BLOCKING") == "1":  # a CPU's step launches no kernel
        out.append("CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait for the GPU; unset it outside debugging")
    if shares.get("data", 0.0) >= DATA_SHARE:
        loader = plan.loader.value if plan.loader is not None else "as built"
        waits = f"loading: {shares['data']:.0%} of each step waits for the next batch (loader {loader})"
        if getattr(loader, "gather", False):  # in-memory tensors, indexed whole: workers send batches slower
            out.append(
                f"{waits}: each is gathered whole from the tensors in memory, which worker processes cannot beat; "
                f"the time is its indexing and copy, which a larger --batch-size spreads over more samples "
                f"(`redline bench --batch-size {sizes}` measures it)"
            )
        else:
            out.append(
                f"{waits}; try `redline train --loader-workers N` (and a dataset that does less per item); "
                "`redline tune` measures loader workers"
            )
    if breakdown.device_busy is not None and 1 - breakdown.device_busy >= IDLE_SHARE:
        out.append(
            f"the GPU is idle {1 - breakdown.device_busy:.0%} of each step"
            + (" though the step runs as CUDA graphs" if graphs else "")
            + ": the host launches kernels slower than they run (a small model or batch); try a larger "
            f"--batch-size (`redline bench --batch-size {sizes}` measures it)"
            + (
                ""
                if graphs
                else ", or CUDA graphs: `redline profile --cuda-graphs on` shows their step (`--compile on "
                "--compile-mode reduce-overhead` a compiled one's), and `redline tune` measures both"
            )
        )
    if shares.get("optimizer", 0.0) >= OPTIMIZER_SHARE:
        taken = f"the optimizer step takes {shares['optimizer']:.0%} of each step"
        planned = plan.optimizer.value if plan.optimizer is not None else None
        way = "fused" if "fused" in (planned, optimizer) else optimizer  # the Plan's, or the one the user built
        if way is not None:  # fusing it, or stepping its tensors together, is not left to propose
            out.append(
                f"{taken} though it runs {way}: its cost does not grow with the batch, so a larger --batch-size "
                f"spreads it (`redline bench --batch-size {sizes}` measures it)"
            )
        elif plan.optimizer is not None and (timed := FUSED_TIMED.search(plan.optimizer.reason)):  # kept: too slow
            out.append(
                f"{taken}: its parameter tensors are stepped one by one, and its fused kernel stepped {timed[1]}x as "
                "fast here, too little to take (the Plan's optimizer row): foreach=True in the optimizer's factory "
                "steps them together, which `redline bench` measures"
            )
        else:
            out.append(
                f"{taken}: many small parameter tensors are stepped one by one unless the optimizer is foreach "
                "or fused (the Plan's optimizer row says which)"
            )
    precision = plan.precision.value
    if precision != "fp32" and precision.split("-")[0] not in {f.split("-")[0] for f in fast}:  # bf16-true too
        fastest = f"{fast[0]}," if fast else ""
        out.append(
            f"{precision} has no fast arithmetic on this device, where fp32 is likely faster (bf16 autocast ran a CNN "
            f"30x slower than fp32 on an AVX2 CPU): `redline bench --precision fp32,{fastest}{precision}` measures it"
        )
    if not out:
        out.append(_arithmetic_bound(plan, shares, fast=fast, sizes=sizes))
    return out


def _arithmetic_bound(plan: Plan, shares: dict[str, float], *, fast: Sequence[str], sizes: str) -> str:
    """The advice where no phase stands out: what may still shorten the arithmetic, unless the Plan runs it already or
    timed it here and ran faster without."""
    compute = shares.get("forward", 0.0) + shares.get("backward", 0.0)
    precision = plan.precision.value
    axes = (  # what may shorten the arithmetic, whether the Plan runs it, and whether it was timed against it
        ("reduced precision", precision != "fp32" or not fast, measured(plan.precision)),  # none on this device
        ("compile", plan.compile is not None and bool(plan.compile.value), measured(plan.compile)),
    )
    left = [what for what, taken, timed in axes if not taken and not timed]
    lost = [what for what, taken, timed in axes if not taken and timed]
    bigger = f"a larger --batch-size (`redline bench --batch-size {sizes}` measures it) or a faster device"
    if left:
        then = f"{' or '.join(left)} may shorten it, and `redline tune` measures {'both' if len(left) > 1 else 'it'}"
        then += f" ({' and '.join(lost)} ran slower here, as the Plan measured)" if lost else ""
    elif lost:
        then = f"{' and '.join(lost)} ran slower here, as the Plan measured: {bigger} is what is left"
    else:
        runs = (
            "reduced precision and compiled"
            if fast
            else "compiled (this device has no reduced precision faster than fp32)"
        )
        then = f"the Plan already runs {runs}: {bigger} is what is left"
    bound = f"forward and backward take {compute:.0%} of each step, so the model's own arithmetic bounds it"
    return f"no phase stands out: {bound}; {then}"


def measured(choice: Choice[Any] | None) -> bool:
    """Whether a Plan row was decided by timing its candidates on this machine (auto's trial, or a tune; not a tune's
    axis whose alternatives it did not try: a compile for a planned run shorter than any compile takes)."""
    if choice is None or "not tried" in choice.reason:
        return False
    return choice.reason.startswith(("measured", "tuned "))
