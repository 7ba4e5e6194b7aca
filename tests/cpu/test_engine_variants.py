"""The engine's weight precisions and layouts: bf16-true casts the weights once, channels_last lays them out NHWC;
a measured winner timed on a copy becomes the engine's own model."""

import json
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from redline.cli.main import app
from redline.hardware.device import FAKE_CPU_ENV, DeviceFacts
from redline.plan import inference
from redline.runtime.cache import CACHE_ENV
from redline.serve import engine as engine_module
from redline.serve.engine import InferenceEngine

SLEEP_S = 0.005  # a slow setting: 20-50 times the tiny model's own call


class Conv(nn.Module):
    """A seeded small CNN; with ``slow_unless``, its forward sleeps unless its weights are in that dtype and layout."""

    def __init__(self, slow_unless=None):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.mix = nn.Conv2d(4, 4, 3, padding=1)  # 4 input channels: its two layouts differ (one channel's do not)
        self.head = nn.Linear(4 * 8 * 8, 3)
        self.slow_unless = slow_unless

    def forward(self, x):
        if self.slow_unless is not None and layout(self.mix.weight) != self.slow_unless:
            time.sleep(SLEEP_S)
        return self.head(torch.relu(self.mix(torch.relu(self.conv(x)))).flatten(1))


def layout(weight):
    """The weight's dtype, and whether it is laid out channels_last (and not NCHW)."""
    return weight.dtype, weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def engine(model, **options):
    return InferenceEngine(
        model, input_shape=(1, 8, 8), device="cpu", compile="off", **{"max_batch_size": 4, **options}
    )


def reference(inputs):
    with torch.no_grad():
        return Conv()(inputs)


def test_bf16_true_casts_the_weights_once_in_place_and_returns_float32_outputs_close_to_fp32():
    model = Conv()
    made = engine(model, precision="bf16-true", channels_last="off")
    assert made.model is model, "the engine takes the model over and converts it in place"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert made.plan["precision"].value == "bf16-true" and made.plan["precision"].reason == "requested"
    inputs = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    outputs = made.predict(inputs)
    assert outputs.dtype == torch.float32 and outputs.shape == (3, 3)
    expected = reference(inputs)
    assert (outputs - expected).abs().max() <= 0.02 * expected.abs().max(), "bf16 weights: about 0.4% per rounding"
    assert not torch.equal(outputs, expected), "the outputs come from bf16 arithmetic, not fp32"


def test_integer_inputs_reach_a_bf16_true_model_as_integers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(8, 2))
    made = InferenceEngine(model, input_shape=(2,), input_dtype="int64", device="cpu", precision="bf16-true",
                           compile="off", max_batch_size=2)  # fmt: skip
    outputs = made.predict(torch.tensor([[1, 2], [3, 9]]))
    assert outputs.dtype == torch.float32 and outputs.shape == (2, 2) and outputs.isfinite().all()


def test_channels_last_lays_out_weights_and_inputs_and_leaves_the_outputs_as_they_were():
    model = Conv()
    made = engine(model, precision="fp32", channels_last="on")
    assert layout(model.mix.weight) == (torch.float32, True)
    assert made.plan["channels_last"].value is True and made.plan["channels_last"].reason == "requested"
    inputs = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(made.predict(inputs), reference(inputs), rtol=1e-5, atol=1e-5)


def test_channels_last_asked_of_a_model_without_convolutions_is_off_and_says_why():
    made = InferenceEngine(nn.Linear(3, 2), input_shape=(3,), device="cpu", precision="fp32", channels_last="on")
    assert made.plan["channels_last"].value is False
    assert made.plan["channels_last"].reason == "requested, but the model has no 2-d convolution"


def test_a_measured_winner_timed_on_a_copy_becomes_the_engines_model(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")  # a CPU with bf16 arithmetic: bf16 and both layouts are timed
    model = Conv(slow_unless=(torch.bfloat16, True))
    made = engine(model, max_batch_size=2)
    assert made.plan["measured"].value == "6 settings"
    assert (made.plan["precision"].value, made.plan["channels_last"].value) == ("bf16-true", True)
    assert "measured: bf16-true+channels_last ran" in made.plan["precision"].reason
    assert made.model is model and layout(model.mix.weight) == (torch.bfloat16, True)
    assert made._variants == {}, "the copies the other settings were timed on are let go"
    outputs = made.predict(torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(2)))
    assert outputs.dtype == torch.float32 and outputs.shape == (2, 3), "the converted model serves"


def test_the_flags_reach_the_engine_and_bad_values_are_named_by_their_flag(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((3, 1, 8, 8), np.float32))
    args = ["predict", "example:digits", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npy"),
            "--batch-size", "2", "--compile", "off", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--precision", "bf16-true", "--channels-last", "on"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)["plan"]
    assert plan["precision"]["value"] == "bf16-true" and plan["channels_last"]["value"] is True
    assert np.load(tmp_path / "y.npy").dtype == np.float32
    bad = str(CliRunner().invoke(app, [*args, "--channels-last", "sideways"]).exception)
    assert bad.startswith("--channels-last='sideways' is not allowed; expected one of 'auto', 'on', 'off'"), bad
    typo = str(CliRunner().invoke(app, [*args, "--precision", "bf16-ture"]).exception)
    assert typo.startswith("--precision='bf16-ture'") and "did you mean --precision 'bf16-true'" in typo, typo


ODD = """
import torch
from torch import nn
from redline.serve.servable import Servable


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        return self.linear(x + torch.ones(3))  # made in float32: bf16 inputs become float32 again


def make():
    return Servable(model=Odd(), input_shape=(3,), name="odd")
"""


def test_a_model_that_makes_float32_tensors_under_bf16_true_is_told_why_and_the_fix(tmp_path):
    (tmp_path / "odd.py").write_text(ODD)
    np.save(tmp_path / "x.npy", np.zeros((2, 3), np.float32))
    args = ["predict", f"{tmp_path / 'odd.py'}:make", "--input", str(tmp_path / "x.npy"), "--output",
            str(tmp_path / "y.npy"), "--compile", "off"]  # fmt: skip
    error = str(CliRunner().invoke(app, [*args, "--precision", "bf16-true"]).exception)
    assert "mat1 and mat2 must have the same dtype" in error, error
    assert "hint: --precision bf16-true runs the model in bfloat16 throughout" in error
    assert "or pass --precision bf16-mixed (autocast)" in error and not (tmp_path / "y.npy").exists()
    assert CliRunner().invoke(app, [*args, "--precision", "bf16-mixed"]).exit_code == 0, "autocast runs it"


def test_copies_timed_beside_a_compile_run_their_own_weights_not_the_compiled_originals(cache, monkeypatch):
    """Compiling patches the model's forward on the instance: a copy made after it would run the original."""
    h200 = DeviceFacts(type="cuda", name="NVIDIA H200", index=0, capability=(9, 0))
    real_propose = inference.propose
    monkeypatch.setattr(engine_module, "propose", lambda facts, **kw: real_propose(h200, **kw))  # times compiles
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # compiles nothing, patches all the same
    made = InferenceEngine(Conv(), input_shape=(1, 8, 8), device="cpu", max_batch_size=2, cuda_graphs="off")
    (entry,) = (cache / "inference").glob("*.json")
    errors = {
        (t["precision"], t["compiled"], t["channels_last"]): t["error"]
        for t in json.loads(entry.read_text())["measured"]
    }
    assert ("fp32", True, False) in errors, "a compile was timed"
    assert errors[("bf16-true", False, False)] > 0, "the bf16 copy ran bf16 weights: its outputs differ from fp32's"
    assert errors[("fp32", False, True)] < 1e-5 and made.plan["measured"].value == "8 settings"


class Split(Conv):
    """Fast with bf16 weights in channels_last on batches of 2 or more, and with fp32 NCHW weights on one sample
    (outside autocast, which also runs fp32 NCHW weights: its speed beside fp32's would be the machine's)."""

    def forward(self, x):
        fast = (torch.bfloat16, True) if len(x) > 1 else (torch.float32, False)
        if layout(self.mix.weight) != fast or (len(x) == 1 and torch.is_autocast_enabled("cpu")):
            time.sleep(SLEEP_S)
        return self.head(torch.relu(self.mix(torch.relu(self.conv(x)))).flatten(1))


def test_small_buckets_beaten_by_another_setting_run_it_on_a_second_copy(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    model = Split()
    made = engine(model)  # buckets 1, 2 and 4
    assert (made.plan["precision"].value, made.plan["channels_last"].value) == ("bf16-true", True)
    assert "smaller buckets run fp32" in made.plan["precision"].reason
    small = made.plan["small_batches"]
    assert small.value == "fp32 at 1", "bucket 2, timed both ways, runs bf16 weights in channels_last"
    assert "batches of 1 run fp32 on a second copy of the model" in small.reason and " at 2" in small.reason
    assert made.model is model and layout(model.mix.weight) == (torch.bfloat16, True)
    (copy,) = made._variants.values()
    assert layout(copy.mix.weight) == (torch.float32, False), "the copy keeps the fp32 NCHW weights"
    one, three = (torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(n)) for n in (1, 3))
    torch.testing.assert_close(made.predict(one), reference(one), rtol=1e-5, atol=1e-6)
    assert not torch.equal(made.predict(three), reference(three)), "three samples (bucket 4) run the bf16 weights"
    torch.testing.assert_close(made.predict(three), reference(three), rtol=0.05, atol=0.02)
    again = engine(Split())
    assert again.plan["small_batches"].value == "fp32 at 1" and "cached from" in again.plan["measured"].reason


def test_no_second_copy_where_the_weights_would_take_too_much_memory(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    monkeypatch.setattr(engine_module, "host_memory_bytes", lambda: 1000)  # the weights: 3.6 KB
    made = engine(Split())
    small = made.plan["small_batches"]
    assert small.value is None and "a second copy of the weights" in small.reason
    assert made._variants == {} and "small_batches" in made.plan_dict()
    assert made.plan["precision"].value == "fp32", "bf16 weights lose on one sample: one setting keeps fp32"


def test_one_setting_fastest_on_every_bucket_needs_no_second_copy(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    made = engine(Conv(slow_unless=(torch.bfloat16, True)))
    small = made.plan["small_batches"]
    assert small.value is None and "one setting serves every bucket" in small.reason
    assert made._variants == {}


def test_a_fall_back_after_the_split_was_timed_leaves_one_setting_and_says_why(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    made = engine(Split())
    split = made.plan["small_batches"].value
    assert split is not None and split.startswith("fp32 at 1")
    made._fall_back("compile", "compile failed, ran eagerly: x")  # as the warm-up does when a compile fails
    assert made.plan["small_batches"].value == split, "both settings were timed eagerly: the split stands"
    made._fall_back("cuda_graphs", "capture failed, running without graphs: x")  # as after a failed capture
    small = made.plan["small_batches"]
    assert small.value is None and "the split was timed with cuda_graphs on, which fell back" in small.reason
    assert made._variants == {} and made._runner_of(1) is made._runner_of(4), "the second copy is let go"
    assert made.predict(torch.zeros(1, 1, 8, 8)).shape == (1, 3)


def test_a_failure_timing_the_buckets_between_leaves_one_setting(cache, monkeypatch):
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    real = engine_module.time_settings

    def failing_on_two(runners, zeros, probe, **options):
        if len(zeros) == 2:
            raise RuntimeError("no kernel for this size")
        return real(runners, zeros, probe, **options)

    monkeypatch.setattr(engine_module, "time_settings", failing_on_two)
    made = engine(Split())
    small = made.plan["small_batches"]
    assert small.value is None and "timing the buckets between failed: RuntimeError: no kernel" in small.reason
    assert made._variants == {} and made.predict(torch.zeros(3, 1, 8, 8)).shape == (3, 3)


class CompiledFast(Conv):
    """A CNN that sleeps unless it runs through the compiled forward (``fake_compile``), or, with ``slower``,
    only there."""

    compiled = False

    def __init__(self, slower=False):
        super().__init__()
        self.slower = slower

    def forward(self, x):
        if CompiledFast.compiled == self.slower:
            time.sleep(SLEEP_S)
        return super().forward(x)


def fake_compile(fn, **options):
    """torch.compile's stand-in: the forward as it was, run with ``CompiledFast.compiled`` set."""

    def compiled(*args, **kwargs):
        CompiledFast.compiled = True
        try:
            return fn(*args, **kwargs)
        finally:
            CompiledFast.compiled = False

    return compiled


@pytest.mark.parametrize("faster", [True, False])
def test_on_a_cpu_the_setting_kept_is_timed_compiled_and_the_compile_kept_where_it_wins(cache, monkeypatch, faster):
    monkeypatch.setenv(FAKE_CPU_ENV, "avx2")  # no bf16 candidates: the layouts alone are timed, then the compile
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    monkeypatch.setattr(torch, "compile", fake_compile)
    model = CompiledFast(slower=not faster)
    made = InferenceEngine(model, input_shape=(1, 8, 8), device="cpu", max_batch_size=4)
    compiled = made.plan["compile"]
    entries = [json.loads(path.read_text()) for path in (cache / "inference").glob("*.json")]
    timed = {(t["precision"], t["compiled"], t["channels_last"]) for entry in entries for t in entry["measured"]}
    kept = made.plan["channels_last"].value
    assert ("fp32", True, kept) in timed and ("fp32", True, not kept) not in timed, "only the setting kept compiled"
    if faster:
        assert compiled.value is True and "+compile ran" in compiled.reason and "measured now" in compiled.reason
    else:
        assert compiled.value is False and "a candidate must run 5% faster" in compiled.reason
    made.warm_up()
    inputs = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(made.predict(inputs), reference(inputs), rtol=1e-4, atol=1e-5)


def split_until_compiled(slow_at_one):
    """``time_settings`` with made-up times (the outputs still compared): eager, as ``Split`` (bf16 weights in
    channels_last fastest on 2 or more samples, fp32 NCHW weights on one); compiled, faster than either, or slower
    on one sample with ``slow_at_one``."""
    real = engine_module.time_settings

    def cost(setting, bucket):
        if setting.compiled:
            return 0.004 if slow_at_one and bucket == 1 else 0.001
        fastest = ("bf16-true", True) if bucket > 1 else ("fp32", False)
        return 0.002 if (setting.precision, setting.channels_last) == fastest else 0.006

    def timed(runners, zeros, probe, **options):
        measured = real(runners, zeros, probe, **options)
        return [replace(t, block_s=(cost(t.setting, len(zeros)),) * 5) if t.block_s else t for t in measured]

    return timed


@pytest.mark.parametrize("slow_at_one", [False, True])
def test_buckets_split_off_eager_are_timed_again_against_the_compile_kept(cache, monkeypatch, slow_at_one):
    # On a CPU the split is timed eager and the compile after it, on the buckets kept: the buckets split off ran
    # the other setting eager even where the setting kept, compiled, beat it (digits on a Xeon with AMX, at 16).
    monkeypatch.setenv(FAKE_CPU_ENV, "amx")
    monkeypatch.setattr(engine_module, "compile_supported", lambda device_type: (True, ""))
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)  # compiles nothing, patches all the same
    monkeypatch.setattr(engine_module, "time_settings", split_until_compiled(slow_at_one))
    made = InferenceEngine(Conv(), input_shape=(1, 8, 8), device="cpu", max_batch_size=4)
    assert made.plan["compile"].value is True, made.plan["compile"].reason
    assert (made.plan["precision"].value, made.plan["channels_last"].value) == ("bf16-true", True)
    small = made.plan["small_batches"]
    assert small.reason.startswith("with the compile, ") and "measured now" in small.reason
    one = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    if slow_at_one:
        assert small.value == "fp32 at 1" and len(made._variants) == 1, "fp32 eager still wins one sample"
        torch.testing.assert_close(made.predict(one), reference(one), rtol=1e-5, atol=1e-6)
    else:
        assert small.value is None and "one setting serves every bucket, bf16-true" in small.reason
        assert made._variants == {}, "no second copy for buckets no other setting runs"
        assert not torch.equal(made.predict(one), reference(one)), "one sample runs the compiled bf16 weights"
    made._fall_back("compile", "compile failed, ran eagerly: x")  # as the warm-up does when a compile fails
    small = made.plan["small_batches"]
    if slow_at_one:
        assert small.value == "fp32 at 1" and "2 run bf16" not in small.reason, "the split timed eager is back"
        torch.testing.assert_close(made.predict(one), reference(one), rtol=1e-5, atol=1e-6)
    else:  # the fp32 weights were let go: the bf16 ones serve every bucket
        assert small.value is None and "the compile, faster on every bucket, fell back" in small.reason
        torch.testing.assert_close(made.predict(one), reference(one), rtol=0.05, atol=0.02)
