"""Inference axes: which precision, layout and compile settings an InferenceEngine times, which it keeps; CUDA graphs.

A rule proposes, a measurement decides: where the device's facts cannot rank the settings, the engine
times them. ``propose`` lists the settings worth timing against the reference (fp32, NCHW and eager,
unless a value was given) from the device's facts; the engine times each on its largest and smallest
buckets, and ``choose`` keeps the fastest one that beats the reference by ``MARGIN`` on the largest,
loses by no more than that on the smallest, and whose outputs stay within ``TOLERANCE`` of the
reference's. Everything here is a pure function of facts and numbers: tests feed it a GPU, or
timings, as data.

Inference has two precisions training has not: ``bf16-true`` and ``fp16-true`` cast the weights
once, where autocast (``-mixed``) casts them on every call. On a Xeon with AMX a 4096-wide MLP ran
bf16-true 3.7x faster than fp32 on batches of 32, and bf16-mixed 0.5x: per call, autocast's casts of
the weights cost more than the bf16 matmuls save (benchmarks/results/engine-cpu-xeon-amx.md).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from redline.errors import invalid, one_of
from redline.hardware.device import DeviceFacts
from redline.plan import Choice, parse_switch, times
from redline.plan.layout import resolve_channels_last
from redline.plan.precision import PrecisionName, fast_precisions, resolve_precision

# A candidate must run this much faster than the reference to be kept: below it, a shared
# machine's noise could make "auto" slower than the plain fp32 eager model.
MARGIN = 1.05
# The largest departure of a candidate's outputs from the reference's, relative to the reference
# outputs' largest magnitude. bf16 keeps 8 bits of mantissa (about 0.4% per rounding); a few layers
# of it stay well inside 5%, while a model that breaks under autocast lands far outside.
TOLERANCE = 0.05

# The most of the device's memory a second copy of the weights may take: the engine keeps one where
# another setting runs the small buckets faster (a bf16 model held once more in fp32, say).
SECOND_COPY_SHARE = 0.1

Measure = Literal["auto", "off"]
# Training's precisions, and the ones whose weights are cast once: what an engine runs in.
InferencePrecision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-true", "fp16-true"]
INFERENCE_PRECISIONS: tuple[str, ...] = get_args(InferencePrecision)
TRUE_OF: dict[str, InferencePrecision] = {"bf16-mixed": "bf16-true", "fp16-mixed": "fp16-true"}
MIXED_OF: dict[str, PrecisionName] = {"bf16-true": "bf16-mixed", "fp16-true": "fp16-mixed"}  # autocast's name for it


def check_inference_precision(requested: str) -> None:
    """Refuse a precision no engine takes ("auto" or one of INFERENCE_PRECISIONS), whatever the device."""
    if requested not in (*INFERENCE_PRECISIONS, "auto"):
        raise one_of("precision", requested, ("auto", *INFERENCE_PRECISIONS))


def autocast_of(precision: InferencePrecision) -> PrecisionName:
    """The autocast a precision runs under: its own for a mixed one, none (fp32) where the weights are cast."""
    return precision if precision in ("bf16-mixed", "fp16-mixed") else "fp32"


@dataclass(frozen=True)
class Setting:
    """One way to run the model: its precision, whether it is compiled, and whether it is laid out channels_last."""

    precision: InferencePrecision
    compiled: bool
    channels_last: bool = False

    @property
    def label(self) -> str:
        """How reasons name it: ``fp32``, ``bf16-mixed+compile``, ``bf16-true+channels_last``."""
        return self.precision + ("+channels_last" if self.channels_last else "") + ("+compile" if self.compiled else "")

    @property
    def variant(self) -> tuple[str, bool]:
        """What the model's weights must be for it: their precision (cast or not) and layout."""
        return (self.precision if self.precision in MIXED_OF else "fp32", self.channels_last)


@dataclass(frozen=True)
class Proposal:
    """The reference setting, the candidates to time against it, and the rule's choices if none is timed."""

    reference: Setting
    candidates: tuple[Setting, ...]
    precision: Choice[InferencePrecision]
    compile: Choice[bool]
    channels_last: Choice[bool]
    # Time the kept setting compiled once the others are timed (a CPU, where compiling every candidate
    # for a trial would take minutes): the engine keeps the compile where it wins.
    compile_after: bool = False


@dataclass(frozen=True)
class Timing:
    """One setting, measured: seconds per call of each timed block, its outputs' error, or why it failed."""

    setting: Setting
    block_s: tuple[float, ...] = ()
    error: float = 0.0  # max |outputs - reference's| / max |reference's|
    failed: str = ""

    @property
    def median_s(self) -> float:
        """The median block: what the choice compares."""
        return statistics.median(self.block_s) if self.block_s else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, for the cache."""
        return {
            "precision": self.setting.precision,
            "compiled": self.setting.compiled,
            "channels_last": self.setting.channels_last,
            "block_s": list(self.block_s),
            "error": self.error,
            "failed": self.failed,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timing:
        """Read back ``to_dict()``."""
        setting = Setting(data["precision"], bool(data["compiled"]), bool(data.get("channels_last", False)))
        block_s = tuple(float(s) for s in data["block_s"])
        if not all(math.isfinite(s) and s > 0 for s in block_s):  # edited on disk: no block takes no time
            raise ValueError(f"block_s {list(block_s)} are not all positive")
        return cls(setting, block_s, float(data["error"]), str(data["failed"]))


def read_measure(requested: object) -> bool:
    """Read the ``measure`` option: "auto" (or True) measures, "off" (or False) uses the rules."""
    if requested in (True, "auto", "on"):
        return True
    if requested in (False, "off"):
        return False
    raise invalid("measure", requested, "'auto' or 'off'", "measure='off' skips timing and plans by the rules")


def propose(
    facts: DeviceFacts,
    *,
    precision: str,
    compile: str | bool,
    measure: bool,
    compile_supported: Callable[[], tuple[bool, str]],
    channels_last: str | bool = "auto",
    convolutional: bool = False,
) -> Proposal:
    """Return what to time: an explicit value is used as given, an "auto" one is timed where a rule cannot rank it.

    ``compile_supported()`` says whether torch.compile can run here and why not; it is asked only
    when a compile is in question (finding out imports the compiler stack). ``convolutional`` says
    whether the model has 2-d convolutions, the layers channels_last lays out. A compiled candidate
    runs on the reference's weights: a setting that casts them or lays them out otherwise runs on
    a copy of the model, and is timed eagerly. On a CPU no compiled candidate is timed with the
    others; ``compile_after`` asks for the setting kept to be timed compiled after them.
    """
    rule_precision = _precision_rule(precision, facts)
    precisions: list[InferencePrecision] = [rule_precision.value]
    if precision == "auto" and measure:
        fast = fast_precisions(facts)
        precisions = ["fp32", *fast, *(TRUE_OF[p] for p in fast)]
    rule_compile, compiles, compile_after = _compile_rule(compile, facts, measure, compile_supported)
    rule_layout, layouts = _layout_rule(channels_last, facts, convolutional, measure, rule_precision.value)
    reference = Setting(precisions[0], compiles[0], layouts[0])
    settings = (Setting(p, c, cl) for p in precisions for c in compiles for cl in layouts)
    candidates = tuple(s for s in settings if s != reference and (not s.compiled or s.variant == reference.variant))
    return Proposal(reference, candidates, rule_precision, rule_compile, rule_layout, compile_after)


def _precision_rule(requested: str, facts: DeviceFacts) -> Choice[InferencePrecision]:
    """The precision without a measurement; an explicit one is checked against the device and used as given."""
    check_inference_precision(requested)
    if requested == "bf16-true" and facts.type == "cuda" and not facts.bf16:
        raise invalid(
            "precision", requested, f"'fp32', 'fp16-true', 'fp16-mixed' or 'auto' on {facts.name}, which has no "
            "native bf16", "use precision='fp16-true' (fp16 weights) or 'auto'",
        )  # fmt: skip
    if requested in MIXED_OF:
        return Choice(cast(InferencePrecision, requested), "requested")
    rule = resolve_precision(requested, facts)  # refuses bf16-mixed where the GPU lacks bf16
    if requested != "auto":  # training's notes (fp16's loss scaling on a CPU) say nothing of inference
        return Choice(rule.value, "requested")
    return Choice(rule.value, rule.reason)


def _layout_rule(
    requested: str | bool, facts: DeviceFacts, convolutional: bool, measure: bool, precision: InferencePrecision
) -> tuple[Choice[bool], list[bool]]:
    """The channels_last axis without a measurement, and the values to time (the first is the reference's)."""
    if parse_switch("channels_last", requested) is None and convolutional and measure:
        return Choice(False, "auto: NCHW unless channels_last is measured faster"), [False, True]
    mixed = MIXED_OF.get(precision, precision)  # the rule's terms: bf16 weights as bf16
    rule = resolve_channels_last(requested, facts, has_conv2d=convolutional, precision=mixed)
    return rule, [rule.value]


def _compile_rule(
    requested: str | bool, facts: DeviceFacts, measure: bool, supported: Callable[[], tuple[bool, str]]
) -> tuple[Choice[bool], list[bool], bool]:
    """The compile axis without a measurement, the values to time with the others (the first is the reference's),
    and whether to time a compile of the setting kept after them."""
    value = parse_switch("compile", requested)
    if value is False:
        return Choice(False, "requested"), [False], False
    if value is True:
        can, why_not = supported()
        if can:
            return Choice(True, "requested"), [True], False
        return Choice(False, f"requested, but {why_not}; running eagerly"), [False], False
    if not measure:
        return Choice(False, "auto, not measured: a compile is kept only where it is measured faster"), [False], False
    can, why_not = supported()
    if not can:
        return Choice(False, f"auto: {why_not}"), [False], False
    if facts.type != "cuda":
        # On a CPU a compile takes seconds per bucket, and its gain depends on the model: on a Xeon with AMX it
        # ran a VGG-style CNN's batches of 32 2.5x faster (bf16 weights in channels_last), the digits CNN's
        # single samples 0.7x and the MLP 0.9-1.0x (benchmarks/results/engine-cpu-xeon-amx.md). Only the
        # setting the others' timing kept is compiled and timed.
        return Choice(False, "auto: eager unless a compile of the setting kept is measured faster"), [False], True
    return Choice(False, "auto: eager unless compiling is measured faster"), [False, True], False


# Seconds below which a job's whole eager time leaves a CPU compile nothing to win: compiling takes seconds
# (the digits CNN's: 5.6 s on a 2-core EPYC) and saves part of the job's time at most (2.6x, the most a
# compile has won here, saves 62% of it).
COMPILE_PAYBACK_S = 3.0


def short_job(setting: Setting, timing: Timing | None, batches: int | None) -> str | None:
    """Why a compile of ``setting`` is not timed for a job of ``batches`` batches of the largest bucket, at the
    speed ``timing`` measured: its whole run eagerly takes less than ``COMPILE_PAYBACK_S``. None where it is timed
    (no job length given, as a server's, or a job long enough)."""
    if batches is None or timing is None or not timing.block_s:
        return None
    job_s = timing.median_s * batches
    if job_s >= COMPILE_PAYBACK_S:
        return None
    return (
        f"auto: eager; the job's {batches} batch{'es' if batches != 1 else ''} take about {job_s:.2g} s eagerly "
        f"({setting.label}), less than a compile would take, so none was timed"
    )


def check_cuda_graphs(requested: str | bool, device_type: str) -> bool | None:
    """Read ``requested`` (True, False, or None for auto); refuse CUDA graphs asked of a device that is not CUDA."""
    value = parse_switch("cuda_graphs", requested)
    if value is True and device_type != "cuda":
        raise invalid(
            "cuda_graphs", requested, f"'auto' or 'off' on {device_type}",
            "pass cuda_graphs='auto' (on for CUDA devices, off elsewhere) or 'off': CUDA graphs need a CUDA device",
        )  # fmt: skip
    return value


def resolve_cuda_graphs(requested: str | bool, facts: DeviceFacts) -> Choice[bool]:
    """Decide whether each bucket runs as a captured CUDA graph: on CUDA devices, unless turned off."""
    value = check_cuda_graphs(requested, facts.type)
    if value is not None:
        return Choice(value, "requested")
    if facts.type == "cuda":
        return Choice(
            True,
            "auto: one graph per bucket replays the whole forward in one launch (a small model is bound by launches)",
        )
    return Choice(False, f"auto: CUDA graphs need a CUDA device, this is {facts.type}")


def verdict(reference: Timing, candidate: Timing, *, tolerance: float = TOLERANCE) -> str:
    """Return why ``candidate`` cannot be kept whatever its speed ("" when it can)."""
    if candidate.failed:
        return candidate.failed
    if not math.isfinite(candidate.error):
        return "its outputs turned non-finite"
    if candidate.error > tolerance:
        return f"its outputs are {candidate.error:.1%} off {reference.setting.label}'s (tolerance {tolerance:.0%})"
    return ""


def choose(
    proposal: Proposal,
    timings: Sequence[Timing],
    *,
    bucket: int,
    small: tuple[int, Sequence[Timing]] | None = None,
    margin: float = MARGIN,
    tolerance: float = TOLERANCE,
    split: bool = False,
) -> dict[str, Choice[Any]]:
    """Return the engine's plan entries (precision, compile, channels_last, measured) from timings whose first is
    the reference's.

    ``timings`` were taken on the largest bucket, ``small`` (when given) holds the smallest bucket and
    the same settings' timings there. A candidate is accepted if it beats the reference by ``margin``
    on the largest bucket and does not lose by ``margin`` on the smallest: a cost paid per call
    (autocast casting the weights, say) can make a candidate that wins on full batches several times
    slower on the single requests of a lightly loaded server. The fastest accepted one on the largest
    bucket is kept; where others come within ``margin`` of it there (a tie, as far as the timing can
    tell), the fastest of those on the smallest. Otherwise the reference stays. Each reason carries
    the numbers; an axis that was not timed keeps the rule's choice.

    With ``split`` (the engine may hold a second copy of the model), a setting fastest on the largest
    bucket but beaten by ``margin`` on the smallest no longer loses: it is kept, and the
    ``small_batches`` entry names the setting the smaller buckets may run instead (see ``split_of``),
    or None, with why one setting serves every bucket. Both are compiled or neither.
    """
    reference, *others = timings
    ratios = {t.setting: reference.median_s / t.median_s for t in others if t.block_s}
    rejected = {t.setting: verdict(reference, t, tolerance=tolerance) for t in others}
    small_ratios: dict[Setting, float] = {}
    blocks = f"median of {len(reference.block_s)} blocks"
    where = f"on the largest bucket ({bucket}), {blocks}"
    if small is not None:
        small_bucket, (small_reference, *small_others) = small
        for t in small_others:
            rejected[t.setting] = rejected[t.setting] or verdict(small_reference, t, tolerance=tolerance)
            small_ratios[t.setting] = small_reference.median_s / t.median_s if t.block_s else 0.0
        where = f"on the largest bucket ({bucket}) and the smallest ({small_bucket}), {blocks}"
    at_small = f" at {small[0]}" if small is not None else ""
    told = "; ".join(
        f"{t.setting.label} rejected: {rejected[t.setting]}" if rejected[t.setting]
        else f"{t.setting.label} {times(ratios[t.setting])}"
        + (f" ({times(small_ratios[t.setting])}{at_small})" if t.setting in small_ratios else "")
        for t in others
    )  # fmt: skip
    summary = f"{reference.setting.label} {reference.median_s * 1e3:.3g} ms per batch; {told} ({where})"
    accepted = [
        t for t in others
        if not rejected[t.setting] and ratios.get(t.setting, 0.0) >= margin
        and small_ratios.get(t.setting, 1.0) >= 1 / margin
    ]  # fmt: skip
    best = _fastest(accepted, ratios, small_ratios, margin)
    measured = Choice(f"{len(timings)} settings", summary)
    pair = split_of(reference, others, rejected, ratios, small_ratios, margin) if split and small else None
    if pair is not None:
        kept, lighter = pair
        gain = f"ran {times(ratios[kept])} {reference.setting.label}" if kept in ratios else "kept, the fastest"
        why = (
            f"measured: {kept.label} {gain} on the largest bucket ({bucket}); smaller buckets run {lighter.label}, "
            f"{times(small_ratios.get(lighter, 1.0) / small_ratios.get(kept, 1.0))} {kept.label}{at_small}"
        )
        return {**_timed_axes(proposal, kept, why), "measured": measured,
                "small_batches": Choice(lighter, why)}  # fmt: skip
    if best is None:
        losing = f" at {bucket} and lose no more than {margin - 1:.0%}{at_small}" if small is not None else ""
        rule = f"a candidate must run {margin - 1:.0%} faster{losing}, within tolerance"
        kept, why = reference.setting, f"measured: {reference.setting.label} kept ({rule}): {told}, {where}"
    else:
        also = f" ({times(small_ratios[best.setting])}{at_small})" if best.setting in small_ratios else ""
        kept = best.setting
        why = f"measured: {kept.label} ran {times(ratios[kept])} {reference.setting.label}{also} {where}"
    entries = {**_timed_axes(proposal, kept, why), "measured": measured}
    if split and small is not None:
        entries["small_batches"] = Choice(
            None, f"one setting serves every bucket: no other runs {margin - 1:.0%} faster than it at {small[0]} "
            f"while losing by as much at {bucket}",
        )  # fmt: skip
    return entries


def split_of(
    reference: Timing,
    others: Sequence[Timing],
    rejected: dict[Setting, str],
    ratios: dict[Setting, float],
    small_ratios: dict[Setting, float],
    margin: float,
) -> tuple[Setting, Setting] | None:
    """The setting for the largest bucket and another for the smallest, where each beats the other by ``margin`` on
    its own bucket (None where one setting serves both). Speeds are against the reference (1.0 for itself); each
    is the reference or beats it by ``margin`` on its bucket, and both are compiled alike.

    On a Xeon with AMX the digits CNN ran 2.67x fp32 with bf16 weights in channels_last on batches of 32,
    and 0.48x on single samples: one setting for every bucket gives up one or the other.
    """
    valid = [reference.setting, *(t.setting for t in others if t.block_s and not rejected[t.setting])]
    at_large = {s: ratios.get(s, 1.0) for s in valid}
    at_small = {s: small_ratios.get(s, 1.0) for s in valid}
    # each is the reference or beats it by the margin on its own bucket, as the single-setting rule asks
    winners = [s for s in valid if s == reference.setting or at_large[s] >= margin]
    large = max(winners, key=lambda s: (at_large[s], at_small[s]))
    lighter = [  # one compile (or none) serves both
        s for s in valid if s.compiled == large.compiled and (s == reference.setting or at_small[s] >= margin)
    ]
    small = max(lighter, key=lambda s: (at_small[s], at_large[s]), default=None)
    if (
        small is not None
        and at_small[small] >= margin * at_small[large]
        and at_large[large] >= margin * at_large[small]
    ):
        return large, small
    return None


def split_buckets(
    large: Setting, small: Setting, timings: Mapping[int, Sequence[Timing]]
) -> tuple[frozenset[int], Choice[str | None]]:
    """The buckets ``small`` runs, and the plan's entry saying so: the smallest buckets up to the one where
    ``small``'s gains, summed from the smallest bucket up (in log terms), are the greatest; none where it gains on
    none (``large`` compiled, timed again on the buckets ``small`` won against it eager).

    ``timings`` holds each timed bucket's timings of both settings (and perhaps others). The buckets
    ``small`` runs are the smallest ones, with no gap: two settings' times on a bucket between often
    differ by less than the machine's noise (on a 2-core AVX2 machine one start split digits at 1, 2,
    4 and 16, the next at 1 and 2), and a gap would be noise, not speed.
    """
    speedups: dict[int, float] = {}
    for bucket, timed in sorted(timings.items()):
        medians = {t.setting: t.median_s for t in timed}
        # inf where large failed, 0 where small did (a failed timing's median is infinite)
        speedups[bucket] = medians[large] / medians[small] if medians[small] > 0 else math.inf
    gain, best, runs = 0.0, 0.0, frozenset[int]()
    for bucket, x in speedups.items():
        gain += math.log(min(x, 1e6)) if x > 0 else -math.inf  # a bucket only small ran must be small's
        if gain > best:
            best, runs = gain, frozenset(b for b in speedups if b <= bucket)
    shown = ", ".join(f"{times(x)} at {b}" for b, x in speedups.items())
    if not runs:
        return runs, Choice(None, f"one setting serves every bucket, {large.label}; {small.label} against it: {shown}")
    buckets = ", ".join(map(str, sorted(runs)))
    copy = " on a second copy of the model" if small.variant != large.variant else ""
    reason = (
        f"measured: batches of {buckets} run {small.label}{copy}, the rest "
        f"{large.label}; {small.label} against {large.label}: {shown}"
    )
    return runs, Choice(f"{small.label} at {buckets}", reason)


def _fastest(
    accepted: list[Timing], ratios: dict[Setting, float], small_ratios: dict[Setting, float], margin: float
) -> Timing | None:
    """The accepted timing fastest on the largest bucket; of those within ``margin`` of it, the fastest on the
    smallest (on a Xeon with AMX, bf16 autocast and bf16 weights in channels_last ran a CNN 3.87x and 3.82x fp32
    on batches of 32, and 1.72x and 2.15x on single samples)."""
    if not accepted:
        return None
    best = max(ratios[t.setting] for t in accepted)
    ties = [t for t in accepted if ratios[t.setting] * margin >= best]
    return max(ties, key=lambda t: (small_ratios.get(t.setting, 0.0), ratios[t.setting]))


def _timed_axes(proposal: Proposal, setting: Setting, reason: str) -> dict[str, Choice[Any]]:
    """Each axis's choice: ``setting``'s value for the ones the candidates varied, the rule's for the others."""
    settings = [proposal.reference, *proposal.candidates]

    def varied(field: str) -> bool:
        return len({getattr(s, field) for s in settings}) > 1

    return {
        "precision": Choice(setting.precision, reason) if varied("precision") else proposal.precision,
        "compile": Choice(setting.compiled, reason) if varied("compiled") else proposal.compile,
        "channels_last": Choice(setting.channels_last, reason) if varied("channels_last") else proposal.channels_last,
    }


def no_room_for_copy(weight_bytes: int, memory_bytes: float, device_type: str) -> str:
    """Why the engine holds no second copy of weights of ``weight_bytes`` ("" where it may): the copy would take
    more than ``SECOND_COPY_SHARE`` of the device's ``memory_bytes``."""
    if weight_bytes <= SECOND_COPY_SHARE * memory_bytes:
        return ""
    return (
        f"one setting serves every bucket: another, faster on small batches, would need a second copy of the "
        f"weights ({weight_bytes / 2**20:.0f} MiB), over {SECOND_COPY_SHARE:.0%} of the {device_type}'s "
        f"{memory_bytes / 2**30:.0f} GiB"
    )
