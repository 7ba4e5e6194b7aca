"""torch.compile with its time recorded and a fall back to eager when compiling fails."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import itertools
import logging
import shutil
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from redline.errors import describe_error
from redline.hardware.device import DeviceFacts
from redline.plan import Choice
from redline.plan.compile import resolve_compile
from redline.runtime.compiler_facts import (
    NEW_FRAME,
    backward_with_forward,
    captured_graphs,
    compiled_frames,
    frames,
    graphs_held,
    is_compiler_error,
    last_guard_failure,
    recompile_hint,
)
from redline.runtime.options import RESUMED, RuntimeOptions

log = logging.getLogger("redline")
# Each compiled module's record, for a bench or a tune to tell a row that ran eagerly (kept no longer than the module)
_RECORDS: weakref.WeakKeyDictionary[nn.Module, CompileRecord] = weakref.WeakKeyDictionary()
_COMPILES = itertools.count(1)  # numbers each compiled forward's code name


def compile_supported(device_type: str) -> tuple[bool, str]:
    """Return whether torch.compile can run for ``device_type`` here, and if not, why."""
    try:
        import torch._dynamo as dynamo
    except Exception as exc:  # a broken install must not stop the run: eager still works
        return False, f"torch._dynamo does not import ({exc})"
    if not dynamo.is_dynamo_supported():
        return False, f"torch.compile does not support Python {sys.version_info.major}.{sys.version_info.minor} here"
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        return False, "triton is not installed, which torch.compile needs for CUDA kernels"
    if device_type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return False, "no C++ compiler found, which torch.compile needs for CPU kernels"
    if device_type == "mps":
        return False, "torch.compile's MPS backend is still experimental"
    return True, ""


@contextlib.contextmanager
def own_forward(module: nn.Module, eager: Callable[..., Any]) -> Iterator[None]:
    """Run ``module``'s own forward (``eager``) inside, whatever form (compiled, graphed) it is in; that form after."""
    current = module.forward
    module.forward = eager
    try:
        yield
    finally:
        module.forward = current


@dataclass
class CompileRecord:
    """What happened to a compiled module: every compile (the first and each recompile), its time, and any fall back."""

    seconds: float | None = None  # all compiles together
    fell_back: str | None = None
    compiles: int = 0
    training: int = 0  # of them, the ones under autograd (a training forward); the rest ran under no_grad
    training_seconds: float = 0.0  # the time of those: spent inside training steps (evaluation's is timed apart)
    recompiles: list[str] = field(default_factory=list)  # why each recompile happened, as torch's guards say
    uncompiled: int = 0  # calls torch.compile tried and gave up on, run eagerly (its recompile limit, say)
    calls: int = 0  # calls of the compiled forward
    eager_calls: int = 0  # of them, the ones that ran eagerly: those given up on, and every later one torch skipped
    per_bucket: bool = False  # an inference engine's: a graph for each batch bucket is the plan, not a recompile
    module: nn.Module | None = None
    eager: Any = None  # the module's own forward, before compiling
    code: Any = None  # the code object torch.compile keeps the graphs of
    parked: Any = None  # the compiled forward while ``use_eager`` has the module run its own
    own: Any = None  # what the module's __dict__ held as "forward" before compiling (``_NO_FORWARD``: nothing)
    installed: Any = None  # the CompiledForward compiling put there

    def restore(self) -> None:
        """Give the module back the forward it had before compiling, unless something else took its place since: a
        closed Runtime's model runs as its user built it, and a later Runtime (compile off) finds it uncompiled."""
        model = self.module
        if model is None or model.__dict__.get("forward") not in (self.installed, self.eager, self.parked):
            return
        if self.own is _NO_FORWARD:
            model.__dict__.pop("forward", None)
        else:
            model.forward = self.own
        self.parked = None

    def use_eager(self) -> None:
        """Have the module run its own forward from now on (``use_compiled`` brings the compiled one back)."""
        if self.module is not None and self.parked is None:
            self.parked, self.module.forward = self.module.forward, self.eager

    def use_compiled(self) -> None:
        """Bring back the compiled forward ``use_eager`` set aside."""
        if self.module is not None and self.parked is not None:
            self.module.forward, self.parked = self.parked, None

    @contextlib.contextmanager
    def eagerly(self) -> Iterator[None]:
        """Run the module's own (uncompiled) forward inside: for evaluation and sampling, whose shapes vary."""
        if self.module is None:
            yield
            return
        with own_forward(self.module, self.eager):
            yield

    def add(self, seconds: float, cause: str, *, training: bool) -> None:
        self.seconds = (self.seconds or 0.0) + seconds
        self.compiles += 1
        self.training += training
        self.training_seconds += seconds if training else 0.0
        if self.compiles > 1:
            self.recompiles.append(cause)

    def add_backward(self, seconds: float) -> None:
        """Count a backward compile of this record's training graph (``collect_backward_compiles``)."""
        self.seconds = (self.seconds or 0.0) + seconds
        self.training_seconds += seconds


def compiled_by_user(model: nn.Module) -> bool:
    """Whether the user compiled ``model`` (``torch.compile(model)``, or ``model.compile()`` on it or a part)."""
    return hasattr(model, "_orig_mod") or any(
        getattr(m, "_compiled_call_impl", None) is not None for m in model.modules()
    )


def compile_planned(
    model: nn.Module,
    options: RuntimeOptions,
    facts: DeviceFacts,
    *,
    planned_steps: int | None,
    records: list[CompileRecord],
) -> Choice[bool]:
    """Resolve the compile axis and, when it says so, compile ``model`` in the requested mode (its record
    joins ``records``)."""
    if options.cuda_graphs == "on" and options.compile == "auto":  # one form of the forward at a time
        return Choice(False, "auto: off with cuda_graphs='on' (the graphs replay the model's own forward)")
    if compiled_by_user(model):  # its compiles are the caller's: neither counted nor checked against eager
        undo = "; compile='off' cannot undo it: set it up before torch.compile" if options.compile == "off" else ""
        return Choice(True, f"compiled by the caller (torch.compile before setup): run as given{undo}")
    planned = resolve_compile(
        options.compile, facts, planned_steps=planned_steps, supported=lambda: compile_supported(facts.type)
    )
    mode = options.compile_mode
    if not planned.value and mode != "default" and options.compile == "auto":  # asked for a mode: said, not dropped
        log.warning("compile_mode=%r is not used: %s\nhint: pass compile='on' to compile in it", mode, planned.reason)
        return Choice(False, f"{planned.reason}; compile_mode={mode!r} unused (compile='on' compiles in it)")
    if not planned.value:
        return planned
    part = compiled_part(model)
    if not any(record.module is part for record in records):  # set up again: its forward is compiled already
        options_of_mode: dict[str, Any] = {} if mode == "default" else {"mode": mode}
        records.append(compile_module(part, **options_of_mode))
    return planned if mode == "default" else Choice(True, f"{planned.reason}; mode={mode}")


def compiled_part(model: nn.Module) -> nn.Module:
    """The module whose forward to compile: ``model``, or the model inside a DDP wrapper whose forward is torch.nn's
    own (an ``nn.Sequential``). torch.compile skips DDP's own frames and then torch.nn's, so compiling the wrapper
    left such a model eager (a 2-process run "compiled 2 time(s) in 0.3 s"); its own forward then compiles, with
    DDP's gradient hooks left as they are. A model of the user's own class keeps the wrapper compiled, which lets
    torch split its graph at DDP's buckets."""
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else None
    if isinstance(inner, nn.Module) and type(inner).forward.__module__.startswith("torch.nn."):
        return inner
    return model


def compile_counts(records: list[CompileRecord]) -> tuple[int, int, list[str]]:
    """How many times ``records``' models compiled, how many of those for training, and why each recompile happened."""
    recompiles = [c for r in records for c in r.recompiles]
    return sum(r.compiles for r in records), sum(r.training for r in records), recompiles


def compile_seconds(records: list[CompileRecord], *, training: bool = False) -> float | None:
    """Seconds spent compiling (the first compile and every recompile, the backward's included), once a compiled
    model has run; ``training``: those inside training steps (under autograd) alone."""
    collect_backward_compiles()
    seconds = [r.training_seconds if training else r.seconds for r in records if r.seconds is not None]
    return sum(seconds) if seconds else None


COMPILED = "; compiled "  # in the compile row's reason, before the count of compiles


def explain_compile(planned: Choice[bool], records: list[CompileRecord]) -> Choice[bool]:
    """The compile axis as it turned out: a fall back to eager, or every compile counted with its time and cause."""
    fell_back = [r.fell_back for r in records if r.fell_back]
    seconds = compile_seconds(records)
    if fell_back:
        return Choice(False, f"compile failed, ran eagerly: {fell_back[0]}")
    if not planned.value or seconds is None:
        return planned
    count, training = sum(r.compiles for r in records), sum(r.training for r in records)
    causes = [c for r in records if not r.per_bucket for c in r.recompiles]
    # A resumed run's planned reason is its checkpoint's, which counted that stretch's compiles: this one's replace it
    planned_reason = planned.reason.split(COMPILED, 1)[0]
    since = " since the resume" if RESUMED.match(planned_reason) else ""
    reason = f"{planned_reason}{COMPILED}{count} time(s) in {seconds:.1f} s{since}"
    if all(r.per_bucket for r in records):
        reason += " (a graph per batch bucket)"
    elif count > training:
        reason += f" ({training} for training, {count - training} for evaluation under no_grad)"
    if causes:
        reason += f" (recompiled: {'; '.join(dict.fromkeys(causes))})"
    if gave_up := gave_up_on(records):
        reason += f"; {gave_up}"
    return Choice(True, reason)


def eager_calls(records: list[CompileRecord]) -> tuple[int, int]:
    """How many calls of ``records``' compiled forwards ran eagerly (torch gave up compiling them), and of how many."""
    eager = sum(max(r.eager_calls, r.uncompiled) for r in records)  # where torch cannot say, its give-ups at least
    return eager, sum(r.calls for r in records)


def gave_up_on(records: list[CompileRecord]) -> str:
    """How many calls of ``records``' compiled forwards torch.compile gave up on and ran eagerly ("" for none)."""
    return _gave_up(*eager_calls(records))


def _gave_up(eager: int, calls: int) -> str:
    why = "its recompile limit, or a frame it cannot trace"
    return f"torch.compile gave up compiling ({why}): {eager} of {calls} call(s) ran eagerly" if eager else ""


def eager_calls_of(model: nn.Module) -> tuple[int, int]:
    """As ``eager_calls``, for ``model``'s compiled forward ((0, 0) where ``compile_module`` did not compile it)."""
    record = _RECORDS.get(model)
    return eager_calls([record]) if record is not None else (0, 0)


def gave_up_on_model(model: nn.Module) -> str:
    """As ``gave_up_on``, for ``model``'s compiled forward ("" where ``compile_module`` did not compile it)."""
    return _gave_up(*eager_calls_of(model))


@contextlib.contextmanager
def recompile_room(record: CompileRecord | None, graphs: int) -> Iterator[None]:
    """Let torch.compile keep ``graphs`` more graphs of ``record``'s forward than it holds now, inside.

    Its limit (8 by default) counts the graphs of one code object (``compile_module`` gives each model its
    own): past it, a new shape runs eagerly, and only a warning says so.
    """
    if record is None:
        yield
        return
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    need = max(int(getattr(dynamo_config, name)), graphs_held(record.code) + graphs)
    with dynamo_config.patch(name, need):
        yield


def _eager_instead(
    record: CompileRecord, exc: Exception, start: float, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """A call's output from the eager model after the compiler raised ``exc``; the model runs eagerly from then on,
    and says so once. dynamo wraps an error of the model's own ops (a shape mismatch) as its own: where the eager call
    fails too, the error is the user's, raised as the eager model raises it, and the next call compiles."""
    spent, training = time.perf_counter() - start, torch.is_grad_enabled()
    try:
        out = record.eager(*args, **kwargs)
    except Exception as user_error:
        raise user_error from None
    model = record.module
    assert model is not None  # compile_module's record holds its module
    record.fell_back = describe_error(exc)
    record.seconds = (record.seconds or 0.0) + spent  # with the compiles before it, if any
    record.training_seconds += spent if training else 0.0  # a training step's compile, left out of its speed
    log.warning(
        "torch.compile failed for %s (%s); running eagerly\nhint: pass compile='off' to skip the attempt",
        type(model).__name__,
        record.fell_back,
    )
    model.forward = record.eager
    return out


def _count_compile(record: CompileRecord, start: float, backward_before: float) -> None:
    """Count a call of ``record``'s compiled forward that compiled (from ``start``), and say a recompile: in training
    a cost paid again mid-run (a warning), for evaluation its own graph once, an inference engine's bucket planned."""
    training = torch.is_grad_enabled()
    cause = (last_guard_failure(record.code) or NEW_FRAME) if record.compiles else ""
    if training:
        _BackwardCompiles.compiled_for_training(record, backward_before)
    record.add(time.perf_counter() - start, cause, training=training)
    if record.compiles > 1:
        again = training and record.training > 1 and cause != NEW_FRAME  # a frame's first compile is no repeat
        level = logging.DEBUG if record.per_bucket else logging.WARNING if again else logging.INFO
        name, cause = type(record.module).__name__, record.recompiles[-1]
        log.log(level, "torch.compile compiled %s again: %s%s", name, cause, recompile_hint(cause))


def _captured_nothing(record: CompileRecord, start: float, breaks_before: list[str], out: Any) -> Any:
    """``out``, from a first compile that captured no graph of ops (an LSTM, which torch.compile cannot trace, makes
    the whole forward one graph break): the model ran as its own forward, and runs so from then on, said once, and
    the Plan's compile row says compile failed, as where the compiler raised (a bench row so must not pass for
    compiled)."""
    model = record.module
    assert model is not None  # compile_module's record holds its module
    spent = time.perf_counter() - start
    new = [reason for reason in captured_graphs()[1] if reason not in breaks_before]
    why = f": {new[0].strip().splitlines()[0]}" if new else ""
    record.fell_back = f"torch.compile captured no graph of {type(model).__name__}'s forward{why}"
    record.seconds = (record.seconds or 0.0) + spent
    record.training_seconds += spent if torch.is_grad_enabled() else 0.0
    log.warning("%s; running eagerly\nhint: pass compile='off' to skip the attempt", record.fell_back)
    record.restore()  # its own forward from then on, as a closed Runtime leaves it
    return out


class _BackwardCompiles:
    """torch compiles a training graph's backward when it first runs, not with its forward (a second or more on a
    CPU), and times each such compile in its own metrics. The seconds they gained since the last look go to the
    record that compiled for training last: each backward compile follows its forward's."""

    seen: ClassVar[float] = 0.0  # torch's total when last looked at
    latest: ClassVar[weakref.ref[CompileRecord] | None] = None
    keys: ClassVar[list[str]] = []  # the metrics' names of backward compiles
    size: ClassVar[int] = -1  # how many metrics torch kept when ``keys`` were found

    @classmethod
    def total(cls) -> float:
        """The seconds torch spent compiling backward graphs in this process, by its own metrics (0 where it keeps
        none): read before each call of a compiled forward, so cheap."""
        try:
            from torch._dynamo.utils import compilation_time_metrics as metrics
        except Exception:
            return 0.0
        if len(metrics) != cls.size:  # a new metric: look again for the backward compiler's
            cls.keys, cls.size = [key for key in list(metrics) if key.endswith("bw_compiler")], len(metrics)
        return sum(sum(metrics.get(key, ())) for key in cls.keys)

    @classmethod
    def collect(cls, upto: float | None = None) -> None:
        """Add the backward compiles since the last look (up to the total ``upto``, else all) to the latest training
        compile's record."""
        total = cls.total() if upto is None else upto
        gained = total - cls.seen if total >= cls.seen else total  # torch._dynamo.reset() clears its metrics
        cls.seen = total
        record = cls.latest() if cls.latest is not None else None
        if gained > 0 and record is not None:
            record.add_backward(gained)

    @classmethod
    def failed_in_call(cls, before: float) -> None:
        """A call that began with torch's total at ``before`` failed to compile: the backward compiles it timed (one
        that failed, with the forward) are that call's record's, counted with the call, not the latest's."""
        cls.collect(upto=before)
        cls.seen = cls.total()

    @classmethod
    def compiled_for_training(cls, record: CompileRecord, before: float) -> None:
        """``record`` just compiled a training forward, in a call that began with torch's total at ``before``: the
        backward compiles from now on are its. Any in that call (a backward compiled with its forward) were timed
        with the call."""
        cls.collect(upto=before)
        cls.seen, cls.latest = cls.total(), weakref.ref(record)


def collect_backward_compiles() -> None:
    """Bring the backward compiles torch ran since the last look into their records (``CompileRecord.seconds``,
    ``training_seconds``): call before reading them."""
    _BackwardCompiles.collect()


_NO_FORWARD = object()  # a module's __dict__ held no "forward" of its own: its class's runs


class CompiledForward:
    """What ``compile_module`` puts in place of a module's forward: ``call``, its compiled forward.

    A copy of the module (an EMA or a teacher, by ``copy.deepcopy``) runs its own forward (``eager``), eagerly: the
    compiled graphs and their counts are the original's, and would run the original's parameters. Pickled (a
    ``torch.save`` of the whole module), it is the module's own forward too.
    """

    def __init__(self, call: Callable[..., Any], eager: Any) -> None:
        self.call, self.eager = call, eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.eager, memo)  # bound to the module's copy, which the memo holds

    def __reduce__(self) -> tuple[Any, ...]:
        return _same, (self.eager,)


def _same(value: Any) -> Any:
    return value


def compile_module(model: nn.Module, *, per_bucket: bool = False, **options: Any) -> CompileRecord:
    """Compile ``model``'s forward in place and return its record (``per_bucket``: an inference engine's, whose
    batch buckets each compile a graph as planned, told at debug level, not as recompiles).

    The module stays the same object with the same parameter names (no ``_orig_mod.`` prefix).
    ``nn.Module.compile()`` is not used: it compiles ``_call_impl``, a torch.nn frame that dynamo
    skips, so a model built only from torch.nn layers (an ``nn.Sequential``) got no graph at all.
    Every call that compiles (the first, and each recompile: a new shape, grad mode or dtype) is
    counted and timed in the record, with torch's reason for a recompile. If the compiler fails,
    the model logs a warning once with the reason and runs eagerly from then on.
    """
    eager = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        # Traced, this line is dropped (is_compiling() is True then): it runs when torch runs the frame eagerly, as it
        # does every call after giving up on it (its recompile limit), though it counts no frame for those
        if not torch.compiler.is_compiling():
            record.eager_calls += 1
        return eager(*args, **kwargs)

    # torch.compile keeps a forward's graphs, and counts them against its recompile limit, per code object.
    # Given torch.nn's own forward (an nn.Sequential's), it wraps it in a function whose code every such
    # module in the process shares (pytorch#124269): a second model's graphs then ran eagerly past the
    # limit. A code object of the model's own keeps its graphs apart. Its name is its own too: torch keys the
    # shapes it has seen by a code's file, line and name, and a second model of a class, compiled at another batch
    # size (a bench's or a tune's next row), got a graph for dynamic shapes as though its own shape had changed.
    # (A frame past a graph break inside a submodule's forward has that class's code, shared still.)
    forward.__code__ = forward.__code__.replace(co_name=f"{type(model).__name__}_forward_{next(_COMPILES)}")
    compiled = torch.compile(forward, **options)
    # CUDA graphs (mode="reduce-overhead") replay into the same output buffers: each forward starts a
    # new step, so the last step's outputs are never mistaken for live ones (a no-op without CUDA graphs).
    graphs = options.get("mode") == "reduce-overhead"
    record = CompileRecord(module=model, eager=eager, code=forward.__code__, per_bucket=per_bucket)

    def counted(*args: Any, **kwargs: Any) -> Any:
        """The compiled forward, counting the calls that compiled (a new shape, grad mode or dtype recompiles); where
        the compiler fails, this call and every later one run the model's own forward."""
        if torch.compiler.is_compiling():  # traced inside another compiled model's forward: that one compiles it
            return eager(*args, **kwargs)
        before, tried, start = compiled_frames(), frames("total"), time.perf_counter()
        graphs_before, breaks_before = captured_graphs() if not record.compiles else (0, [])
        backward_before = _BackwardCompiles.total()
        record.calls += 1
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        # until a training graph has compiled, its backward with it (a graph under no_grad has none)
        lazy = record.training or not torch.is_grad_enabled()
        try:
            with contextlib.nullcontext() if lazy else backward_with_forward():
                out = compiled(*args, **kwargs)
        except Exception as exc:
            # an inference engine's later bucket: the engine falls back itself (its split, its runners)
            if not is_compiler_error(exc) or (per_bucket and record.calls > 1):
                raise
            _BackwardCompiles.failed_in_call(backward_before)
            return _eager_instead(record, exc, start, args, kwargs)
        compiled_now = compiled_frames() != before
        if not compiled_now and frames("total") != tried:  # tried, gave up, ran eagerly
            record.uncompiled += 1
            log.warning("torch.compile ran %s eagerly: it gave up compiling this call", type(model).__name__)
        elif compiled_now and not record.compiles and not per_bucket and captured_graphs()[0] == graphs_before:
            return _captured_nothing(record, start, breaks_before, out)
        elif compiled_now:
            _count_compile(record, start, backward_before)
        return out

    record.own = model.__dict__.get("forward", _NO_FORWARD)
    model.forward = record.installed = CompiledForward(counted, eager)
    _RECORDS[model] = record
    return record
