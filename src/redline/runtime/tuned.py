"""A tuned Plan: the settings `redline tune` measured fastest for a Task on this machine, cached on disk.

The cache is keyed like the trial's (the Task's fingerprint, this machine's facts, the batch
size), so ``redline train --plan tuned`` and auto find it again, and a changed model or machine
misses it. A tuned Plan fixes the axes it measured (precision, compile and its mode, layout,
loader workers, micro-batching) and keeps the numbers that decided each, which become the
Plan's reasons for the run that uses it. An axis a tune left unmeasured (its budget spent, or a
Ctrl-C) is not fixed: the run decides it as auto would. What a run takes from a tune, and when auto takes one,
is runtime/tuned_run.py's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from redline.atomic import check_writable, make_parent, write_atomic
from redline.errors import ConfigError
from redline.hardware.device import DeviceFacts
from redline.plan.attention import plan_kernel
from redline.plan.layout import resolve_channels_last
from redline.runtime.cache import CACHE_ENV, cache_dir, cache_key
from redline.runtime.options import LAID_OUT_BY_AUTO, RuntimeOptions
from redline.task import model_fingerprint

log = logging.getLogger("redline")
MICRO_BATCHES = "micro-batches per step"  # how a tuned grad_accum's reason names it; a resumed run reads it
# In a tune's budget line where other processes kept the CPUs busy while it searched: a neighbour slows some settings
# far more than others (a bf16 step's threads wait for each other), so the winner may lose on a quiet machine.
NOT_TAKEN_BUSY = "plain auto does not take it (--plan tuned does); tune again on a quiet machine"
BUSY_NOTE = "searched while {}: " + NOT_TAKEN_BUSY
TUNED_AXES = (
    "precision", "compile", "compile_mode", "cuda_graphs", "channels_last", "attention", "loader_workers", "grad_accum",
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One setting of every axis a tune searches; ``grad_accum`` micro-batches make one step of the same batch."""

    precision: str = "fp32"
    compile: bool = False
    compile_mode: str = "default"
    cuda_graphs: bool = False  # the forward and backward replayed as CUDA graphs, without a compile
    channels_last: bool = False
    attention: str = "auto"  # scaled_dot_product_attention's kernel; "auto": torch picks per call
    loader_workers: int | None = None  # None: the device's rule
    grad_accum: int = 1

    @property
    def label(self) -> str:
        parts = [self.precision, f"compiled ({self.compile_mode})" if self.compile else "eager"]
        if self.cuda_graphs:
            parts.append("CUDA graphs")
        if self.channels_last:
            parts.append("channels_last")
        if self.attention != "auto":
            parts.append(f"{self.attention} attention")
        if self.loader_workers is not None:
            parts.append(f"{self.loader_workers} workers")
        if self.grad_accum > 1:
            parts.append(f"{self.grad_accum} micro-batches")
        return ", ".join(parts)

    def options(self, base: RuntimeOptions, facts: DeviceFacts | None = None) -> RuntimeOptions:
        """``base`` with this candidate's axes set, for a run on the device of ``facts`` (None: any).

        NHWC goes through "auto" where auto lays the candidate's precision out NHWC on that device: the model's image
        outputs then come back NCHW and a forward that fails in NHWC goes back to NCHW, where "on" would hand NHWC
        outputs to a loss or metric that views them (runtime/layout.py)."""
        rule = resolve_channels_last("auto", facts, has_conv2d=True, precision=self.precision) if facts else None
        auto = rule is not None and rule.value
        values: dict[str, Any] = {
            "precision": self.precision,
            "compile": "on" if self.compile else "off",
            "compile_mode": self.compile_mode,
            "cuda_graphs": "on" if self.cuda_graphs else "off",
            "channels_last": ("auto" if auto else "on") if self.channels_last else "off",
            "attention": self.attention,
            "loader_workers": self.loader_workers,
            "grad_accum": self.grad_accum,
        }
        return dataclasses.replace(base, **values)  # the tune's values: a field left out at its default stays so


@dataclass(frozen=True)
class Trial:
    """A candidate's measurement: seconds per optimizer step (median window) and compile seconds, and whether
    torch's on-disk compile caches served that compile (a machine that never compiled the model pays more), or the
    seconds are those its graph's first compile in the tune took (``first_compile``: a later axis loads it warm)."""

    candidate: Candidate
    step_s: float | None
    compile_s: float = 0.0
    rejected: str = ""
    compile_cached: bool = False
    first_compile: bool = False

    def total_s(self, planned_steps: int) -> float:
        """The planned run's time under this candidate: its compile, then every step."""
        if self.step_s is None or self.rejected:
            return float("inf")
        return self.compile_s + planned_steps * self.step_s


@dataclass(frozen=True)
class TunedPlan:
    """The winner of a tune, the trials of each axis, and what they were measured on."""

    task: str
    device: str
    batch_size: int
    planned_steps: int
    measured_at: str
    best: Candidate
    reasons: dict[str, str]  # axis -> why the tune chose its value
    trials: tuple[Trial, ...]
    unmeasured: tuple[str, ...] = ()  # axes the tune did not decide (budget spent, Ctrl-C): left to the run's auto
    busy: str = ""  # how busy other processes kept the CPUs while it searched, where that was enough to skew it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> TunedPlan:
        """The Plan a cache entry holds; ValueError naming the field where it is not one (an entry edited by hand,
        or cut short), which the reader says before it counts the entry as none."""
        entry = _typed("the entry", data, dict)
        trials = []
        for index, trial in enumerate(_typed("'trials'", _field(entry, "trials"), list)):
            what = f"trial {index + 1}"
            trial = _typed(what, trial, dict)
            candidate = _candidate(f"{what}'s candidate", _field(trial, "candidate"))
            step_s = _kind(f"{what}'s 'step_s'", trial.get("step_s"), (float, int, type(None)))
            compile_s = _kind(f"{what}'s 'compile_s'", trial.get("compile_s", 0.0), (float, int))
            rejected = _kind(f"{what}'s 'rejected'", trial.get("rejected", ""), (str,))
            cached = _kind(f"{what}'s 'compile_cached'", trial.get("compile_cached", False), (bool,))
            first = _kind(f"{what}'s 'first_compile'", trial.get("first_compile", False), (bool,))
            trials.append(Trial(candidate, step_s, compile_s, rejected, cached, first))
        best = _candidate("the best setting", _field(entry, "best"))
        reasons = _typed("'reasons'", _field(entry, "reasons"), dict)
        for axis, why in reasons.items():
            _kind(f"the reason for {axis!r}", why, (str,))
        try:  # an entry edited by hand fails here, where it is read, not as a flag the run was never given
            best.options(RuntimeOptions())
        except ConfigError as exc:
            raise ValueError(f"its best setting is not one a run can take: {str(exc).splitlines()[0]}") from None
        unmeasured = _typed("'unmeasured'", entry.get("unmeasured", []), list)
        busy = _kind("'busy'", entry.get("busy", ""), (str,))
        return cls(
            task=str(_field(entry, "task")), device=str(_field(entry, "device")),
            batch_size=_kind("'batch_size'", _field(entry, "batch_size"), (int,)),
            planned_steps=_kind("'planned_steps'", _field(entry, "planned_steps"), (int,)),
            measured_at=str(_field(entry, "measured_at")), best=best, reasons=dict(reasons), trials=tuple(trials),
            unmeasured=tuple(a for a in unmeasured if a in TUNED_AXES)
            + tuple(a for a in ("cuda_graphs", "attention") if a not in entry["best"]),  # tuned before they existed
            busy=busy,
        )  # fmt: skip

    def apply(self, options: RuntimeOptions, facts: DeviceFacts | None = None) -> RuntimeOptions:
        """``options`` with the tuned axes, for those the user left to auto (an explicit request wins); an axis
        the tune did not measure keeps what ``options`` say (auto, unless asked otherwise).

        CUDA graphs the tune found faster stay as ``options`` say too: "auto" proposes them on CUDA and the run's
        first steps confirm them, where "on" would refuse a run the tune's one process did not see (several
        processes, micro-batches after running out of memory, a compile asked for).
        """
        base = self.best.options(options, facts)
        other_precision = options.given("precision") and options.precision != self.best.precision
        kept = {
            axis: getattr(options, axis)
            for axis in TUNED_AXES
            if axis in self.unmeasured
            or options.given(axis)
            or (axis == "cuda_graphs" and self.best.cuda_graphs)
            # a kernel and a layout are tuned for their precision: another precision runs auto's (NHWC pays in bf16)
            or (axis in ("attention", "channels_last") and other_precision)
        }
        if kept.get("compile", base.compile) == "off":  # a mode asked for says how a compile runs: eager takes none
            kept["compile_mode"] = "default"
        return dataclasses.replace(base, **kept)  # an axis left out and kept at its default stays left out

    def plan_reasons(self, options: RuntimeOptions) -> dict[str, dict[str, Any]]:
        """The Plan axes the tune decided, as ``Plan.to_dict()`` rows, for ``Runtime.adopt_reasons``.

        An axis ``options`` set otherwise (an explicit request won) keeps its own reason: the tune's
        numbers argued for another value.
        """
        values = {
            "precision": (options.precision, self.best.precision),
            "compile": (options.compile == "on", self.best.compile),
            "cuda_graphs": (options.cuda_graphs == "on", self.best.cuda_graphs),
            "channels_last": (options.channels_last != "off", self.best.channels_last),  # "auto": apply's NHWC
            "attention": (plan_kernel(options.attention), plan_kernel(self.best.attention)),
            "grad_accum": (options.grad_accum, self.best.grad_accum),
            "loader_workers": (options.loader_workers, self.best.loader_workers),  # for the loader, set up later
        }
        through_auto = options.channels_last == "auto" and self.best.channels_last  # the tune's NHWC, as auto's
        notes = {"channels_last": f"; {LAID_OUT_BY_AUTO}" if through_auto else ""}
        # a kernel and a layout tuned for another precision than the run's: auto decided them (apply), not the tune
        own = ("attention", "channels_last") if options.precision != self.best.precision else ()
        return {
            axis: {"value": value, "reason": self.reasons.get(axis, "") + notes.get(axis, "")}
            for axis, (value, tuned) in values.items()
            if value == tuned and axis not in self.unmeasured and axis not in own
        }


def _field(entry: Mapping[str, Any], name: str) -> Any:
    if name not in entry:
        raise ValueError(f"it has no {name!r}")
    return entry[name]


def _typed(what: str, value: Any, kind: type) -> Any:
    """``value`` where it is a ``kind`` (JSON's object or array); else ValueError naming ``what`` it is instead."""
    if not isinstance(value, (list, tuple) if kind is list else kind):  # a to_dict() read back keeps its tuples
        told = "an object" if kind is dict else "an array"
        raise ValueError(f"{what} is {json.dumps(value)[:40]}, not {told}")
    return value


_SETTINGS: dict[str, tuple[type, ...]] = {
    "precision": (str,), "compile": (bool,), "compile_mode": (str,), "cuda_graphs": (bool,), "channels_last": (bool,),
    "attention": (str,), "loader_workers": (int, type(None)), "grad_accum": (int,),
}  # fmt: skip
_WORDS = {str: "a text", bool: "true or false", int: "an integer", float: "a number", type(None): "null"}


def _candidate(what: str, value: Any) -> Candidate:
    """The Candidate an entry's object holds; ValueError naming the setting that is not one a tune writes (a
    "compile": "no" was read as compiling, being a non-empty text)."""
    settings = _typed(what, value, dict)
    for name, setting in settings.items():
        if name not in _SETTINGS:
            raise ValueError(f"{what} has {name!r}, which is not a setting a tune makes")
        _kind(f"{what}'s {name!r}", setting, _SETTINGS[name])
    return Candidate(**settings)


def _kind(what: str, value: Any, kinds: tuple[type, ...]) -> Any:
    """``value`` where it is one of ``kinds`` (true or false being no number); else ValueError naming ``what``."""
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    told = " or ".join(_WORDS[kind] for kind in kinds if not (kind is int and float in kinds))  # a number: either
    raise ValueError(f"{what} is {json.dumps(value)[:40]}, not {told}")


def tuned_key(fingerprint: str, facts: DeviceFacts, batch_size: int) -> str:
    """The key of a tune on this machine: not by thread count, so the workers of `train --nproc N` (each with
    its share of the cores) find the tune a single process made."""
    return cache_key(fingerprint, facts, str(batch_size), "tune", threads=False)


def tuned_path(fingerprint: str, facts: DeviceFacts, batch_size: int) -> Path:
    """Where the tune of this workload on this machine is cached."""
    return cache_dir() / "tuned" / f"{tuned_key(fingerprint, facts, batch_size)}.json"


NOT_SEARCHED = "not searched here"  # how a tune's reason for an axis it skipped on this device begins


def measured_more(fingerprint: str, facts: DeviceFacts, tuned: TunedPlan) -> tuple[TunedPlan, Path] | None:
    """The cached tune, and where, that a stopped search (``tuned``, with the axes it left unmeasured) must not replace:
    one of the same workload and run length that measured every axis it did, and more. None where there is none."""
    earlier = load_tuned(fingerprint, facts, tuned.batch_size)
    if earlier is None or earlier.planned_steps != tuned.planned_steps:
        return None  # a tune for another run length decided compile for that length
    # An axis not searched here (CUDA graphs on a CPU) counts for neither: an earlier version's tune, made before
    # that axis existed, reads it as unmeasured.
    skipped = {axis for axis, why in tuned.reasons.items() if str(why).startswith(NOT_SEARCHED)}
    if not set(earlier.unmeasured) - skipped < set(tuned.unmeasured):
        return None
    return earlier, tuned_path(fingerprint, facts, tuned.batch_size)


def load_tuned(fingerprint: str, facts: DeviceFacts, batch_size: int) -> TunedPlan | None:
    """The cached tuned Plan of this workload on this machine, or None (an unreadable entry counts as none)."""
    path = tuned_path(fingerprint, facts, batch_size)
    try:
        return TunedPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (FileNotFoundError, NotADirectoryError):  # no tune could be stored there: a tune names the file in the way
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("the tuned Plan in %s could not be read (%s); run `redline tune` again", path, exc)
        return None


def store_tuned(fingerprint: str, facts: DeviceFacts, tuned: TunedPlan, *, model: nn.Module | None = None) -> str:
    """Cache ``tuned`` atomically; return where it went. With ``model``, also under the model's own
    fingerprint, where a bare ``Runtime(plan="tuned")`` looks (it knows the model, not the Task)."""
    path = tuned_path(fingerprint, facts, tuned.batch_size)
    text = json.dumps(tuned.to_dict(), indent=2, allow_nan=False) + "\n"

    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    try:
        for target in [path] + ([_model_path(model, facts)] if model is not None else []):
            make_parent(target)
            write_atomic(target, write)
    except OSError as exc:
        raise _uncachable(path.parent, exc) from None
    return str(path)


def check_tuned_cache() -> None:
    """Refuse a cache a tune could not be stored in before the search spends its budget, not after it."""
    folder = cache_dir() / "tuned"
    try:
        make_parent(folder / "tuned.json")
        check_writable(folder / "tuned.json")
    except OSError as exc:
        raise _uncachable(folder, exc) from None


def _uncachable(folder: Path, exc: OSError) -> ConfigError:
    if isinstance(exc, NotADirectoryError) and exc.filename:  # make_parent names the file in the way
        return ConfigError(
            f"a tuned Plan cannot be cached in {folder}: {exc.filename} is a file, where the cache's directory goes\n"
            f"hint: move it, or set {CACHE_ENV} to a directory you can write to, then tune again"
        )
    return ConfigError(
        f"a tuned Plan cannot be cached in {folder} ({exc.strerror or exc})\n"
        f"hint: set {CACHE_ENV} to a directory you can write to, then tune again"
    )


def _model_path(model: nn.Module, facts: DeviceFacts) -> Path:
    """Where a model's own tune is kept: keyed by its structure and shapes, not its modules' plain settings, which
    may differ by rank (``self.device = f"cuda:{rank}"``) where every rank of a job must find the one tune."""
    key = tuned_key(model_fingerprint(model, settings=False), facts, 0)
    return cache_dir() / "tuned" / "models" / f"{key}.json"


def tuned_for_model(model: nn.Module, facts: DeviceFacts, options: RuntimeOptions) -> tuple[RuntimeOptions, Tuning]:
    """For ``Runtime(plan="tuned")``: ``options`` with the newest tune of this model on this machine applied.

    The Runtime does not own the loop's batches, so a tuned micro-batching is told, not applied.
    Without a tune of this model here, a ConfigError says how to make one.
    """
    path = _model_path(model, facts)
    try:
        tuned = TunedPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        raise ConfigError(
            f"plan='tuned': no tuned Plan for this {type(model).__name__} on this machine ({facts.name}) in "
            f"{path.parent}\nhint: run `redline tune --task SPEC` on a Task with this model first, or use plan='auto'"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"plan='tuned': the tuned Plan of this {type(model).__name__} in {path} could not be read ({exc})\n"
            "hint: run `redline tune --task SPEC` on a Task with this model again, or use plan='auto'"
        ) from None
    applied = dataclasses.replace(tuned.apply(options, facts), grad_accum=options.grad_accum)
    reasons = tuned.plan_reasons(applied)
    if (k := tuned.best.grad_accum) > 1 and not options.given("grad_accum"):
        told = f"not applied: the tune ran {k} {MICRO_BATCHES} faster; your loop owns the batches: "
        reasons["grad_accum"] = {"value": 1, "reason": told + f"split each in {k} and pass grad_accum={k} to use it"}
    note = f"tuned {tuned.measured_at} at batch {tuned.batch_size} for {tuned.planned_steps} steps"
    return applied, Tuning(reasons, note)


@dataclass(frozen=True)
class Tuning:
    """The Plan reasons a tuned Plan gives the axes it set, and the note that says where they came from."""

    reasons: dict[str, dict[str, Any]]
    note: str
