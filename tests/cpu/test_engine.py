"""The InferenceEngine on a CPU: padding and chunking, explicit and measured choices, the cache, fall backs, broken."""

import contextlib
import json
import re
import threading
import time
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

import redline
from redline.errors import ConfigError, DeviceUnavailableError, ServableError
from redline.hardware.device import FAKE_CPU_ENV
from redline.plan import Choice
from redline.runtime.cache import CACHE_ENV
from redline.serve import engine as engine_module
from redline.serve.engine import InferenceEngine, WarmUpStopped
from redline.serve.runners import CaptureFailed, EagerRunner, GraphRunner, copy_out, pad_to
from redline.serve.servable import Servable

SLEEP_S = 0.02


class Spy(nn.Module):
    """A seeded linear layer that records each batch's size and whether autocast was on.

    Under autocast it can sleep (a slow candidate) or shift its outputs (an inaccurate one); in fp32
    it can sleep too, so that a candidate is the faster one, and with its weights cast (bf16-true; as in fp32
    unless given). A sleep given as {batch size: seconds} sleeps on those sizes only. A sample holding
    ``poison`` raises ``error``.
    """

    def __init__(
        self, *, autocast_sleep_s=0.0, autocast_shift=0.0, fp32_sleep_s=0.0, cast_sleep_s=None, poison=None, error=None
    ):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 2)
        self.autocast_sleep_s, self.autocast_shift, self.fp32_sleep_s = autocast_sleep_s, autocast_shift, fp32_sleep_s
        self.cast_sleep_s = fp32_sleep_s if cast_sleep_s is None else cast_sleep_s  # with its weights cast (bf16-true)
        self.poison, self.error = poison, error
        self.sizes: list[int] = []
        self.autocast_calls = 0

    def forward(self, x):
        self.sizes.append(x.shape[0])
        if self.poison is not None and bool((x == self.poison).any()):
            raise self.error
        out = self.linear(x)
        if torch.is_autocast_enabled("cpu"):
            self.autocast_calls += 1
            sleep(self.autocast_sleep_s, x.shape[0])
            return out + self.autocast_shift
        sleep(self.fp32_sleep_s if self.linear.weight.dtype == torch.float32 else self.cast_sleep_s, x.shape[0])
        return out


def sleep(seconds, rows):
    time.sleep(seconds.get(rows, 0.0) if isinstance(seconds, dict) else seconds)


def plain(model, **options):
    """An engine that measures nothing: fp32, eager."""
    return InferenceEngine(model, input_shape=(3,), device="cpu", precision="fp32", compile="off", **options)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def bf16_cpu(monkeypatch):
    """Plan as on a CPU with bf16 arithmetic, so that "auto" times bf16 against fp32."""
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")


def test_padded_batches_return_exactly_their_rows_equal_to_the_eager_model():
    model = Spy()
    engine = plain(model, max_batch_size=8)
    engine.warm_up()
    assert sorted(set(model.sizes)) == [1, 2, 4, 8]
    inputs = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for rows in range(1, 9):
        model.sizes.clear()
        out = engine.predict(inputs[:rows])
        assert out.shape == (rows, 2) and out.device.type == "cpu"
        torch.testing.assert_close(out, model.linear(inputs[:rows]).detach(), rtol=0, atol=1e-6)
        assert model.sizes == [next(b for b in (1, 2, 4, 8) if b >= rows)], "the batch was padded to its bucket"


def test_a_batch_beyond_max_batch_size_runs_in_chunks_and_keeps_its_order():
    model = Spy()
    engine = plain(model, max_batch_size=8)
    inputs = np.random.default_rng(2).normal(size=(19, 3)).astype(np.float64)  # cast to the input dtype
    engine.warm_up()
    model.sizes.clear()
    out = engine.predict(inputs)
    assert model.sizes == [8, 8, 4]
    expected = model.linear(torch.as_tensor(inputs, dtype=torch.float32)).detach()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_predict_warms_up_first_and_refuses_a_wrong_shape():
    model = Spy()
    engine = plain(model, max_batch_size=4)
    assert not engine.ready
    engine.predict(torch.zeros(3, 3))
    assert engine.ready and sorted(set(model.sizes)) == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"\(N, 3\)"):
        engine.predict(torch.zeros(3, 4))


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (np.array([[1, 2, 3]], dtype=object), r"batch='array of object' is not allowed; expected real numbers"),
        ("abc", r"batch='str' is not allowed; expected real numbers"),
        ([[1, 2, 3], [1, 2]], r"batch='list' is not allowed; .*\nhint: .*expected sequence of length 3"),
        (np.zeros((2, 3), np.complex64), r"batch='complex64' is not allowed; expected real numbers"),
        (np.zeros(3, np.float32), r"batch='shape \(3,\)' .*\nhint: one sample\? add the batch dimension"),
    ],
)
def test_predict_refuses_what_is_not_a_batch_of_real_numbers_naming_it_and_the_fix(batch, message):
    model = Spy()
    engine = plain(model, max_batch_size=4)
    with pytest.raises(ConfigError, match=message):
        engine.predict(batch)
    assert model.sizes == [], "nothing reached the model"


class AsFloats(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        self.seen.append(x)
        return x.float()


@pytest.mark.parametrize(
    ("dtype", "batch", "message"),
    [
        ("uint8", [[7, 300, 2]], r"batch='row 0 holding 300' is not allowed; expected whole numbers within uint8's "
                                 r"range \[0, 255\]\nhint: the cast to the input dtype uint8 would change it"),
        ("int64", [[1, 2, 3], [1.5, 2, 3]], r"batch='row 1 holding 1.5' .* expected whole numbers within int64's"),
        ("int64", [[1, 2, float("nan")]], r"batch='row 0 holding nan'"),
        ("int32", [[0, 0, 2**40]], r"batch='row 0 holding 1099511627776' .* within int32's range"),
        ("float16", [[1.0, 1e6, 0.0]], r"batch='row 0 holding 1000000.0' .* within float16's range ±65504"),
        ("bool", [[0, 2, 1]], r"batch='row 0 holding 2' is not allowed; expected 0 or 1 \(False or True\)"),
        ("float32", [[1e300, 0.0, 0.0]], r"batch='row 0 holding 1e\+300' .* within float32's range"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("given", [np.array, list])
def test_predict_refuses_values_the_cast_to_the_input_dtype_would_change_without_a_word(dtype, batch, message, given):
    # 300 became 44 in uint8, NaN -9.2e18 in int64, 2**40 zero in int32, 1e6 infinity in float16, 1e300 a NaN
    # output in float32: wrong answers; nested lists too (torch made their floats float32 before the check)
    model = AsFloats()
    engine = InferenceEngine(model, input_shape=(3,), input_dtype=dtype, device="cpu", precision="fp32",
                             compile="off", max_batch_size=2)  # fmt: skip
    engine.warm_up()
    model.seen.clear()
    with pytest.raises(ConfigError, match=message):
        engine.predict(given(batch))
    assert model.seen == [], "nothing reached the model"


def test_nested_lists_keep_their_float64_values_for_a_float64_input():
    model = AsFloats()
    engine = InferenceEngine(model, input_shape=(1,), input_dtype="float64", device="cpu", precision="fp32",
                             compile="off", max_batch_size=2)  # fmt: skip
    engine.predict([[0.1]])
    assert model.seen[-1].dtype == torch.float64 and model.seen[-1].item() == 0.1, "not 0.1 rounded to float32"


@pytest.mark.parametrize(
    ("dtype", "batch"),
    [("uint8", [[0, 255, 2]]), ("int64", [[1.0, -2.0, 3.0]]), ("float16", [[1.5, -65504.0, float("nan")]]),
     ("bool", [[0, 1, 1]]), ("int32", np.array([[1, 2, 3]], np.int64)), ("int64", np.array([[1, -2, 3]], np.int8)),
     ("float32", np.array([[True, False, True]])), ("float16", np.array([[True, False, True]]))],
)  # fmt: skip
def test_predict_casts_values_the_input_dtype_holds_as_they_are(dtype, batch):
    engine = InferenceEngine(AsFloats(), input_shape=(3,), input_dtype=dtype, device="cpu", precision="fp32",
                             compile="off", max_batch_size=2)  # fmt: skip
    expected = torch.as_tensor(np.array(batch, dtype=np.float64)).float()
    torch.testing.assert_close(engine.predict(np.array(batch)), expected, equal_nan=True)


def test_a_model_of_scalar_samples_is_told_its_batch_shape_as_python_writes_it():
    engine = InferenceEngine(AsFloats(), input_shape=(), device="cpu", precision="fp32", compile="off",
                             max_batch_size=2)  # fmt: skip
    assert engine.predict(np.array([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ConfigError, match=r"batch='shape \(2, 1\)' is not allowed; expected \(N,\)$"):
        engine.predict(np.zeros((2, 1)))
    with pytest.raises(ConfigError, match=r"expected \(N,\)\nhint: one sample\? .* batch\[None\] has shape \(1,\)$"):
        engine.predict(np.float32(2))


def test_a_warm_up_asked_to_stop_ends_before_its_next_bucket_and_can_run_again():
    model = Spy()
    engine = plain(model, max_batch_size=4)
    stop = threading.Event()
    model.register_forward_hook(lambda *_: stop.set())  # asked to stop while the first bucket runs
    with pytest.raises(WarmUpStopped, match="before the bucket of 2"):
        engine.warm_up(stop)
    assert model.sizes == [4] and not engine.ready
    engine.warm_up()
    assert engine.ready and model.sizes == [4, 4, 2, 1]


def test_a_bare_module_needs_its_input_shape_and_the_error_names_the_fix():
    with pytest.raises(ConfigError, match="needs input_shape") as caught:
        InferenceEngine(nn.Linear(3, 2), device="cpu")
    assert "hint: InferenceEngine(model, input_shape=" in str(caught.value)
    with pytest.raises(ConfigError, match=r"^input_shape=3 is not allowed; expected positive integers"):
        InferenceEngine(nn.Linear(3, 2), input_shape=3, device="cpu")  # type: ignore[arg-type]  # a slip for (3,)
    servable = Servable(model=nn.Linear(3, 2), input_shape=(3,))
    with pytest.raises(ConfigError, match=r"^input_shape=\(3,\) is not allowed; expected nothing when a Servable"):
        InferenceEngine(servable, input_shape=(3,), device="cpu")
    with pytest.raises(ConfigError, match=r"^input_dtype='float64' is not allowed; .*\nhint: .*leave input_dtype out"):
        InferenceEngine(servable, input_dtype="float64", device="cpu")
    assert isinstance(redline.InferenceEngine(servable, device="cpu", measure="off").servable, Servable)


def test_an_input_dtype_given_as_torchs_is_taken_by_its_name_and_another_is_refused_naming_the_choices():
    servable = Servable(model=nn.Linear(3, 2), input_shape=(3,), input_dtype=torch.float16)  # type: ignore[arg-type]
    assert servable.input_dtype == "float16" and servable.torch_dtype is torch.float16
    with pytest.raises(ConfigError, match=r"^input_dtype=torch.complex64 is not allowed; expected one of float32, "):
        Servable(model=nn.Linear(3, 2), input_shape=(3,), input_dtype=torch.complex64)  # type: ignore[arg-type]


def test_explicit_precision_and_compile_are_used_as_given_without_measuring(cache, bf16_cpu):
    model = Spy()
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", precision="bf16-mixed", compile="off")
    engine.predict(torch.zeros(2, 3))
    assert model.autocast_calls > 0, "the forward ran under bf16 autocast"
    assert engine.plan["precision"].value == "bf16-mixed" and engine.plan["precision"].reason == "requested"
    assert engine.plan["compile"].value is False and engine.plan["compile"].reason == "requested"
    assert "measured" not in engine.plan
    assert not cache.exists(), "nothing was measured, so nothing was cached"


def test_measure_off_plans_by_the_rule(cache, bf16_cpu):
    model = Spy()
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", measure="off")
    assert engine.plan["precision"].value == "fp32" and "AMX" in engine.plan["precision"].reason
    assert model.autocast_calls == 0 and "measured" not in engine.plan


def measured_blocks(cache, precision):
    """The cached seconds per call of each timed block of ``precision``."""
    (entry,) = (cache / "inference").glob("*.json")
    timings = json.loads(entry.read_text())["measured"]
    return next(t["block_s"] for t in timings if t["precision"] == precision)


def test_auto_keeps_fp32_when_bf16_is_slower_and_says_by_how_much(cache, bf16_cpu):
    model = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    precision = engine.plan["precision"]
    assert precision.value == "fp32"
    assert "measured: fp32 kept" in precision.reason and "bf16-mixed 0." in precision.reason
    assert "largest bucket (4)" in precision.reason
    assert min(measured_blocks(cache, "bf16-mixed")) >= SLEEP_S, "bf16 was timed through the sleeping forward"
    trial_calls = model.autocast_calls
    engine.predict(torch.zeros(3, 3))
    assert model.autocast_calls == trial_calls, "after measuring, the engine runs in fp32"


def test_auto_rejects_a_faster_bf16_whose_outputs_depart_from_fp32(cache, bf16_cpu):
    # bf16-true (its weights cast, no autocast: its outputs within tolerance) sleeps 3x fp32's time: slept as long
    # as fp32, the two tied, and a loaded machine's noise (1.14x on one sample) made it the winner or the small
    # buckets' setting
    model = Spy(fp32_sleep_s=SLEEP_S, cast_sleep_s=3 * SLEEP_S, autocast_shift=10.0)
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert engine.plan["precision"].value == "fp32"
    assert "bf16-mixed rejected: its outputs are" in engine.plan["precision"].reason
    assert "off fp32's (tolerance 5%)" in engine.plan["measured"].reason
    assert min(measured_blocks(cache, "fp32")) >= SLEEP_S


def test_auto_runs_bf16_on_full_batches_and_fp32_on_single_requests_where_each_wins(cache, bf16_cpu):
    # As autocast does on a CPU for a wide MLP: it casts the weights on every call, which a batch of 1 cannot repay.
    model = Spy(fp32_sleep_s={4: SLEEP_S}, autocast_sleep_s={1: SLEEP_S}, cast_sleep_s=SLEEP_S)
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    precision, small = engine.plan["precision"], engine.plan["small_batches"]
    assert precision.value == "bf16-mixed" and "on the largest bucket (4); smaller buckets run fp32" in precision.reason
    ratios = precision.reason.split("bf16-mixed ran ")[1]
    # "N.NNx fp32 ... M.MMx bf16-mixed at 1": each by the sleep's margin, which a loaded machine's delays may eat into
    assert float(ratios.split("x")[0]) > 1.2 and float(ratios.split("fp32, ")[1].split("x")[0]) > 1.2
    assert small.value.startswith("fp32 at 1") and "fp32 against bf16-mixed:" in small.reason
    assert engine._variants == {}, "autocast runs on the fp32 weights: no second copy"
    engine.warm_up()
    before = model.autocast_calls
    engine.predict(torch.zeros(1, 3))
    assert model.autocast_calls == before, "a single request runs in fp32"
    engine.predict(torch.zeros(3, 3))
    assert model.autocast_calls == before + 1, "a batch of 3 (bucket 4) runs under autocast"
    both = Spy(fp32_sleep_s=SLEEP_S)  # faster at every size: kept, its ratio on the smallest bucket said
    kept = InferenceEngine(both, input_shape=(3,), device="cpu", compile="off", max_batch_size=2).plan[
        "precision"
    ]  # not cached
    assert kept.value == "bf16-mixed" and " at 1) on the largest bucket (2) and the smallest (1)" in kept.reason


def test_a_measurement_taken_while_the_cpus_were_busy_is_not_cached(cache, bf16_cpu, monkeypatch):
    """Another process's load slows a parallel kernel most: bf16 timed 0.0034x fp32 so, and that was cached."""

    waited = [0.6]  # tasks waited for a CPU 60% of the timing: another process's loop on one of the two CPUs

    class Busy:
        @contextlib.contextmanager
        def counting(self):
            yield

        def share(self):
            return waited[0]

    monkeypatch.setattr(engine_module, "Stalls", Busy)
    first = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    engine = InferenceEngine(first, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert first.autocast_calls > 0 and engine.plan["measured"].reason.endswith(
        "measured now, while the CPUs were busy (tasks waited for one 60% of the time), so not cached"
    )
    waited[0] = 0.0  # a quiet machine
    second = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    engine = InferenceEngine(second, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert second.autocast_calls > 0, "the busy measurement was read from the cache"
    assert engine.plan["measured"].reason.endswith("measured now")
    third = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    engine = InferenceEngine(third, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert third.autocast_calls == 0 and "cached from" in engine.plan["measured"].reason


def test_a_second_engine_reads_the_measurement_from_the_cache(cache, bf16_cpu):
    first = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    InferenceEngine(first, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert first.autocast_calls > 0
    second = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)  # the same architecture: the same fingerprint
    engine = InferenceEngine(second, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert second.autocast_calls == 0 and second.sizes == [], "nothing ran: the measurement came from the cache"
    assert engine.plan["precision"].value == "fp32" and "cached from" in engine.plan["measured"].reason
    other_bucket = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    InferenceEngine(other_bucket, input_shape=(3,), device="cpu", compile="off", max_batch_size=2)
    assert other_bucket.autocast_calls > 0, "another largest bucket is measured anew"
    retrained = Spy(autocast_sleep_s=SLEEP_S, cast_sleep_s=SLEEP_S)
    with torch.no_grad():
        retrained.linear.weight.add_(0.5)
    InferenceEngine(retrained, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert retrained.autocast_calls > 0, "other weights are measured anew: the accuracy verdict depends on them"


def test_a_split_measured_on_the_buckets_between_is_read_from_the_cache_by_the_next_engine(cache, bf16_cpu):
    # Spy counts its calls in public attributes, as a model with a step counter would: the cache keys must not
    # change as the model runs, or the buckets between (timed after the ends) would be measured on every start.
    def split():
        return Spy(fp32_sleep_s={4: SLEEP_S}, autocast_sleep_s={1: SLEEP_S}, cast_sleep_s=SLEEP_S)

    first = split()
    assert (
        InferenceEngine(first, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
        .plan["small_batches"]
        .value.startswith("fp32 at 1")
    )
    assert 2 in first.sizes, "the bucket between the ends was timed"
    second = split()
    engine = InferenceEngine(second, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert second.sizes == [], "nothing ran: the ends' and the buckets' between timings came from the cache"
    assert "cached from" in engine.plan["small_batches"].reason and engine.plan["small_batches"].value.startswith(
        "fp32 at 1"
    )


class CompilerFailure(Exception):
    """Stands in for an error of torch's compiler stack."""


CompilerFailure.__module__ = "torch._inductor.exc"


def test_a_compile_that_fails_falls_back_to_eager_with_the_reason(monkeypatch):
    def failing_compile(fn, **options):
        assert options.get("dynamic") is False, "the buckets are fixed shapes"

        def run(*args, **kwargs):
            raise CompilerFailure("no C++ compiler for this kernel")

        return run

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    model = Spy()
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", precision="fp32", compile="on", max_batch_size=2)
    inputs = torch.randn(2, 3)
    torch.testing.assert_close(engine.predict(inputs), model.linear(inputs).detach(), rtol=0, atol=1e-6)
    compile_choice = engine.plan["compile"]
    assert compile_choice.value is False
    assert "compile failed, ran eagerly" in compile_choice.reason and "no C++ compiler" in compile_choice.reason


def test_a_compile_that_fails_on_a_later_bucket_is_the_engines_own_fall_back(monkeypatch):
    # The first bucket's failure falls back inside the compiled forward; a later one's is the engine's, which sets
    # its split and runners up again without the compile (a compiled forward that swallowed it left them so).
    calls = []

    def failing_later(fn, **options):
        def run(*args, **kwargs):
            calls.append(len(args[0]))
            if len(calls) > 1:
                raise CompilerFailure("no kernel for this bucket")
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(torch, "compile", failing_later)
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    fell_back = []
    monkeypatch.setattr(
        InferenceEngine, "_fall_back", lambda self, axis, reason, own=InferenceEngine._fall_back: (
            fell_back.append(axis), own(self, axis, reason)
        )[1],
    )  # fmt: skip
    model = Spy()
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", precision="fp32", compile="on", max_batch_size=4)
    inputs = torch.randn(2, 3)
    torch.testing.assert_close(engine.predict(inputs), model.linear(inputs).detach(), rtol=0, atol=1e-6)
    assert calls[:2] == [4, 2] and fell_back == ["compile"]  # the largest bucket compiled, the next one failed
    assert engine.plan["compile"].value is False and "no kernel for this bucket" in engine.plan["compile"].reason


def test_compile_on_compiles_every_bucket_at_warm_up_and_matches_eager():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    engine = InferenceEngine(model, input_shape=(3,), device="cpu", precision="fp32", compile="on", max_batch_size=2)
    if not engine.plan["compile"].value:
        pytest.skip(f"torch.compile cannot run here: {engine.plan['compile'].reason}")
    engine.warm_up()
    engine.warm_up()  # again: nothing compiles anew, and the reason is not repeated
    assert engine.plan["compile"].reason.count("compiled 2 time(s)") == 1, engine.plan["compile"].reason
    inputs = torch.randn(2, 3)
    with torch.no_grad():
        expected = engine._record.eager(inputs)
    torch.testing.assert_close(engine.predict(inputs[:1]), expected[:1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(engine.predict(inputs), expected, rtol=1e-5, atol=1e-6)


def test_a_job_too_short_for_a_compile_to_pay_back_times_none_and_a_long_one_does(cache, bf16_cpu, monkeypatch):
    """predict on 100 samples compiled the digits CNN for 5.6 s to time it, for a job of 0.04 s eagerly."""
    compiled = []

    def no_compiler(fn, **options):  # torch.compile, standing still: the test times no real compile
        compiled.append(options)
        return fn

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    slow = {"fp32_sleep_s": SLEEP_S, "autocast_sleep_s": SLEEP_S}  # every setting 20 ms a batch (bf16-true too)
    short = InferenceEngine(Spy(**slow), input_shape=(3,), device="cpu", max_batch_size=1, planned_batches=5)
    reason = short.plan["compile"].reason
    assert short.plan["compile"].value is False and compiled == [], reason
    kept = short.plan["precision"].value
    assert re.match(rf"auto: eager; the job's 5 batches take about 0\.1\d* s eagerly \({kept}\)", reason), reason
    long = InferenceEngine(Spy(**slow), input_shape=(3,), device="cpu", max_batch_size=1, planned_batches=10_000)
    assert compiled, "a job of minutes times the compile of the setting kept"
    assert "+compile" in long.plan["compile"].reason and "the job's" not in long.plan["compile"].reason
    with pytest.raises(ConfigError, match="planned_batches=0 is not allowed"):
        InferenceEngine(Spy(), input_shape=(3,), device="cpu", planned_batches=0)


ILLEGAL = "CUDA error: an illegal memory access was encountered"


def test_a_sticky_cuda_error_marks_the_engine_broken_and_later_calls_refuse():
    engine = plain(Spy(poison=666.0, error=RuntimeError(ILLEGAL)), max_batch_size=4)
    engine.warm_up()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        engine.predict(torch.full((2, 3), 666.0))
    assert engine.broken is not None and "illegal memory access" in engine.broken
    with pytest.raises(DeviceUnavailableError, match="restart"):
        engine.predict(torch.zeros(1, 3))


def test_an_ordinary_model_error_leaves_the_engine_usable():
    engine = plain(Spy(poison=666.0, error=ValueError("bad sample")), max_batch_size=4)
    with pytest.raises(ValueError, match="bad sample"):
        engine.predict(torch.full((2, 3), 666.0))
    assert engine.broken is None
    assert engine.predict(torch.zeros(1, 3)).shape == (1, 2)


def test_the_plan_names_every_axis_and_is_json_ready():
    engine = plain(Spy(), max_batch_size=4)
    engine.warm_up()
    plan = json.loads(json.dumps(engine.plan_dict()))
    assert list(plan) == ["device", "precision", "compile", "channels_last", "cuda_graphs", "buckets"]
    assert plan["buckets"]["value"] == [1, 2, 4]
    assert plan["cuda_graphs"] == {"value": False, "reason": "auto: CUDA graphs need a CUDA device, this is cpu"}


def test_cuda_graphs_on_a_cpu_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="hint: pass cuda_graphs='auto'"):
        plain(Spy(), cuda_graphs="on")


def test_a_bad_or_absent_device_is_named_by_the_engines_own_argument_device():
    with pytest.raises(ConfigError, match=r"^device='gpu' is not allowed; expected 'auto', 'cpu', 'cuda'"):
        InferenceEngine(Spy(), input_shape=(3,), device="gpu")
    with pytest.raises(DeviceUnavailableError, match=r"^device='cuda:99' was requested") as absent:
        InferenceEngine(Spy(), input_shape=(3,), device="cuda:99")
    assert "devices=" not in str(absent.value), "devices= is the Runtime's argument, not the engine's"


def test_padding_and_copying_out_keep_the_rows_and_own_their_memory():
    rows = torch.arange(6.0).reshape(3, 2)
    padded = pad_to(rows, 4)
    assert padded.shape == (4, 2) and torch.equal(padded[:3], rows) and torch.equal(padded[3], torch.zeros(2))
    assert pad_to(rows, 3) is rows
    with pytest.raises(ValueError, match="do not fit"):
        pad_to(rows, 2)
    static = torch.ones(4, 2, dtype=torch.bfloat16)
    out = copy_out(static, 3, 4)
    static.fill_(7)  # a buffer written again, as a CUDA graph's next replay writes its outputs
    assert out.dtype == torch.float32 and torch.equal(out, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"shape \(2, 4\) for a batch of 4; .* one row per input row"):
        copy_out(torch.ones(2, 4), 2, 4)  # classes first: slicing rows would answer with the wrong values


@pytest.mark.parametrize(
    ("returned", "said", "pick"),
    [(lambda y: (y, y[:, :1]), "a tuple of 2 values: tensor (4, 2), tensor (4, 1)", "[0]"),
     (lambda y: {"logits": y}, "a dict with keys 'logits' (tensor (4, 2))", "['logits']")],
)  # fmt: skip
def test_a_model_returning_a_tuple_or_a_dict_is_told_what_it_returned_and_how_to_serve_one_tensor(returned, said, pick):
    class Several(nn.Module):  # transformers' models return a ModelOutput (a dict) or a tuple
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x):
            return returned(self.linear(x))

    with pytest.raises(ServableError) as raised:
        plain(Several(), max_batch_size=4).warm_up()
    assert str(raised.value) == (
        f"the model returned {said}; the engine serves models that return one tensor\nhint: serve a module whose "
        f"forward returns the one tensor meant: a wrapper whose forward(x) returns self.model(x){pick}"
    )


@pytest.fixture
def cuda_on_a_cpu(monkeypatch):
    """torch.cuda's graph calls as no-ops on a CPU, so GraphRunner's own code runs: "captured", the forward runs."""

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            pass

    for name, value in {"device": lambda device: contextlib.nullcontext(), "graph_pool_handle": lambda: None,
                        "Stream": lambda device=None: Stream(), "current_stream": lambda device=None: Stream(),
                        "stream": lambda stream: contextlib.nullcontext(), "CUDAGraph": Graph,
                        "graph": lambda graph, pool=None, stream=None: contextlib.nullcontext(),
                        "set_stream": lambda stream: None}.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)


def test_with_graphs_outputs_no_request_can_be_given_fail_the_capture_not_every_request_after(cuda_on_a_cpu):
    # The eager runner checks the outputs on its first call; a captured graph is not called until a request came.
    runner = GraphRunner(lambda x: (x, x), torch.device("cpu"))
    with pytest.raises(ServableError, match=r"returned a tuple of 2 values: tensor \(4, 3\), tensor \(4, 3\)"):
        runner.prepare(4, torch.zeros(4, 3))
    rows_lost = GraphRunner(lambda x: x[:1], torch.device("cpu"))
    with pytest.raises(ServableError, match=r"shape \(1, 3\) for a batch of 4"):
        rows_lost.prepare(4, torch.zeros(4, 3))
    fine = GraphRunner(lambda x: x * 2, torch.device("cpu"))
    fine.prepare(4, torch.zeros(4, 3))
    assert torch.equal(fine.run(torch.ones(2, 3), 4), torch.zeros(2, 3))  # the no-op replay left the capture's zeros


class FakeGraphs:
    """Stands in for GraphRunner on a CPU: records what was captured and replayed, and runs eagerly."""

    captured: ClassVar[list[int]] = []
    attempts: ClassVar[list[int]] = []  # every bucket a capture was tried on, failed or not
    fail: BaseException | None = None

    def __init__(self, forward, device):
        self.forward, self.device = forward, device
        self.replayed: list[int] = []

    def prepare(self, bucket, sample):
        FakeGraphs.attempts.append(bucket)
        if FakeGraphs.fail is not None:
            raise CaptureFailed(f"bucket {bucket}: {FakeGraphs.fail}") from FakeGraphs.fail
        FakeGraphs.captured.append(bucket)

    def run(self, inputs, bucket):
        self.replayed.append(bucket)
        return copy_out(self.forward(pad_to(inputs, bucket)), inputs.shape[0], bucket)


@pytest.fixture
def fake_graphs(monkeypatch):
    monkeypatch.setattr(engine_module, "GraphRunner", FakeGraphs)
    monkeypatch.setattr(engine_module, "resolve_cuda_graphs", lambda requested, facts: Choice(True, "faked"))
    FakeGraphs.captured, FakeGraphs.attempts, FakeGraphs.fail = [], [], None
    return FakeGraphs


def test_with_graphs_warm_up_captures_every_bucket_largest_first_and_batches_replay_their_bucket(fake_graphs):
    engine = plain(Spy(), max_batch_size=8)
    assert isinstance(engine._runner_of(engine.buckets[-1]), FakeGraphs)
    engine.warm_up()
    assert fake_graphs.captured == [8, 4, 2, 1], "the largest first: the smaller graphs reuse its memory pool"
    engine.predict(torch.zeros(11, 3))
    assert engine._runner_of(engine.buckets[-1]).replayed == [8, 4]


NOT_PERMITTED = RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_running_without_graphs_with_the_reason(fake_graphs):
    fake_graphs.fail = NOT_PERMITTED
    model = Spy()
    engine = plain(model, max_batch_size=4)
    engine.warm_up()
    graphs = engine.plan["cuda_graphs"]
    assert graphs.value is False and "capture failed, running without graphs" in graphs.reason
    assert "operation not permitted" in graphs.reason
    assert isinstance(engine._runner_of(engine.buckets[-1]), EagerRunner) and engine.ready and engine.broken is None
    inputs = torch.randn(3, 3)
    torch.testing.assert_close(engine.predict(inputs), model.linear(inputs).detach(), rtol=0, atol=1e-6)


def test_a_capture_that_failed_while_measuring_is_not_tried_again_on_the_next_start(fake_graphs, cache, bf16_cpu):
    fake_graphs.fail = NOT_PERMITTED
    InferenceEngine(Spy(), input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert fake_graphs.attempts == [4]  # the reference's capture, on the largest bucket
    fake_graphs.attempts.clear()
    second = Spy()
    engine = InferenceEngine(second, input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    graphs = engine.plan["cuda_graphs"]
    assert fake_graphs.attempts == [] and second.sizes == [], "nothing ran: both verdicts came from the cache"
    assert graphs.value is False and "operation not permitted" in graphs.reason and "(cached from " in graphs.reason
    assert "cached from" in engine.plan["measured"].reason


def test_a_capture_out_of_memory_is_tried_again_on_the_next_start(fake_graphs, cache, bf16_cpu):
    fake_graphs.fail = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    InferenceEngine(Spy(), input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    fake_graphs.attempts.clear()
    engine = InferenceEngine(Spy(), input_shape=(3,), device="cpu", compile="off", max_batch_size=4)
    assert fake_graphs.attempts == [4] and engine.plan["cuda_graphs"].value is False


def test_without_cuda_the_engine_runs_eagerly():
    eager = plain(Spy())
    assert isinstance(eager._runner_of(eager.buckets[-1]), EagerRunner)


class Pixels(nn.Module):
    """Sums each image; records the shape and dtype of every batch it is given."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def forward(self, x):
        self.seen.append((tuple(x.shape), x.dtype))
        return x.flatten(1).sum(1, keepdim=True)


def to_floats(pixels):
    return pixels.float().div(255).unsqueeze(1)  # (N, 8, 8) uint8 -> (N, 1, 8, 8) float32


def test_preprocess_turns_request_inputs_into_the_models_batch_before_padding_and_warm_up():
    model = Pixels()
    servable = Servable(model=model, input_shape=(8, 8), input_dtype="uint8", preprocess=to_floats)
    engine = InferenceEngine(servable, device="cpu", precision="fp32", compile="off", max_batch_size=4)
    engine.warm_up()
    assert model.seen == [((size, 1, 8, 8), torch.float32) for size in (4, 2, 1)]  # every bucket, preprocessed
    pixels = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    outputs = engine.predict(pixels)
    assert model.seen[-1] == ((4, 1, 8, 8), torch.float32)  # three rows padded to the bucket of four
    torch.testing.assert_close(outputs, to_floats(pixels).flatten(1).sum(1, keepdim=True))


def test_a_preprocess_that_loses_rows_is_refused_naming_it():
    servable = Servable(model=Pixels(), input_shape=(8, 8), input_dtype="uint8", preprocess=lambda x: x[:1].float())
    engine = InferenceEngine(servable, device="cpu", precision="fp32", compile="off", max_batch_size=2)
    with pytest.raises(ValueError, match=r"preprocess returned shape \(1, 8, 8\) for 2 samples"):
        engine.warm_up()
    with pytest.raises(ConfigError, match="preprocess"):
        Servable(model=Pixels(), input_shape=(8, 8), preprocess="scale")


def test_a_preprocess_that_returns_a_dict_is_told_how_to_serve_a_model_taking_one():
    """Before, the refusal named the dict and stopped there: no word of why, nor of the wrapper that serves it."""
    ids = Servable(model=Pixels(), input_shape=(5,), input_dtype="int64",
                   preprocess=lambda x: {"input_ids": x, "attention_mask": (x != 0).long()})  # fmt: skip
    engine = InferenceEngine(ids, device="cpu", precision="fp32", compile="off", max_batch_size=2)
    with pytest.raises(ServableError) as refused:
        engine.warm_up()
    assert str(refused.value).startswith(
        "preprocess returned dict for 2 samples; expected a tensor of as many rows\n"
        "hint: the engine passes the model one tensor per request batch, so preprocess returns one tensor; to "
        "serve a model that takes a dict of tensors, give the Servable a wrapper module that holds it as a child "
        "(self.inner = model) and whose forward builds the dict from the one tensor and returns the logits"
    )
    assert "--weights of the plain model (redline train --out's) load into that child" in str(refused.value)
