"""`redline predict`: a .npy file in, the engine's outputs out, clear errors and no half-written file."""

import io
import json
import logging
import os
import re
import runpy
import stat
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.torch import save_model
from typer.testing import CliRunner

from redline.cli import predict as predict_module
from redline.cli.main import app
from redline.errors import ConfigError, InferenceError, TaskError, TaskSpecError
from redline.serve import engine as engine_module
from redline.serve.engine import InferenceEngine
from redline.serve.servable import load_servable

FACTORY = '''
import torch
from torch import nn
from redline.serve.servable import Servable


class Poisoned(nn.Module):
    """A seeded linear layer that fails on a sample holding 666, as a model bug would mid-file."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        if bool((x == 666).any()):
            raise RuntimeError("the model failed on a poisoned sample")
        return self.linear(x)


class Narrow(nn.Module):
    """A model that takes 4 features, served as if it took 3: its Linear fails on every batch."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)


def make():
    return Servable(model=Poisoned(), input_shape=(3,), name="tiny")


def misdeclared():
    return Servable(model=Narrow(), input_shape=(3,), name="narrow")


class Pair(nn.Module):
    def forward(self, x):
        return x, x


def pairs():
    return Servable(model=Pair(), input_shape=(3,), name="pairs")


def broken():
    raise RuntimeError("no checkpoint")


class Exits(nn.Module):
    def __init__(self, always=False):
        super().__init__()
        self.always = always

    def forward(self, x):
        if self.always or bool((x == 777).any()):
            raise SystemExit(4)
        return x


def exits():
    return Servable(model=Exits(), input_shape=(3,), name="exits")


def always_exits():
    return Servable(model=Exits(always=True), input_shape=(3,), name="exits")
'''


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "tiny.py").write_text(FACTORY)
    return f"{tmp_path / 'tiny.py'}:make"


def predict(*args):
    return CliRunner().invoke(app, ["predict", *args])


def samples(tmp_path, array, name="x.npy"):
    np.save(tmp_path / name, array)
    return str(tmp_path / name)


def test_the_output_file_holds_the_engines_outputs_for_every_sample(tmp_path, spec):
    inputs = np.random.default_rng(0).normal(size=(11, 3)).astype(np.float32)
    out = tmp_path / "y.npy"
    result = predict(spec, "--input", samples(tmp_path, inputs), "--output", str(out), "--batch-size", "4",
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    written = np.load(out)
    engine = InferenceEngine(load_servable(spec), device="cpu", precision="fp32", compile="off", max_batch_size=4)
    assert written.shape == (11, 2) and np.array_equal(written, engine.predict(inputs).numpy())
    with torch.no_grad():
        plain = load_servable(spec).model(torch.from_numpy(inputs)).numpy()
    np.testing.assert_allclose(written, plain, rtol=0, atol=1e-6)
    assert "11 samples in" in result.output and "samples/s" in result.output
    assert re.search(r"set-up \d+\.\d s, warm-up \d+\.\d s of it", result.output), result.output
    assert "precision" in result.output and "buckets" in result.output, "the plan is printed"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [], "no temporary file remains"


def test_json_prints_the_plan_and_the_summary_as_data_and_nothing_else_on_stdout(tmp_path, spec):
    out = tmp_path / "y.npy"
    result = predict(spec, "--input", samples(tmp_path, np.ones((11, 3), np.float32)), "--output", str(out),
                     "--batch-size", "4", "--precision", "fp32", "--compile", "off", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # no table around it: a pipeline reads it as it is
    assert (data["samples"], data["output_shape"], data["output_dtype"]) == (11, [11, 2], "float32")
    assert data["batch_size"] == 4
    assert (data["input"], data["output"], data["model"]) == (str(tmp_path / "x.npy"), str(out), "tiny")
    assert data["seconds"] > 0 and data["samples_per_s"] == pytest.approx(11 / data["seconds"])
    assert data["setup_s"] >= data["warm_up_s"] >= 0, "the set-up (measuring included) holds the warm-up"
    assert data["plan"]["precision"]["value"] == "fp32" and data["plan"]["buckets"]["value"] == [4]
    assert data["plan"]["buckets"]["reason"].startswith("the batch size alone: every row runs in one setting")
    assert np.load(out).shape == (11, 2)


def test_json_holds_stdout_alone_when_the_models_file_prints_as_it_loads(tmp_path, spec, redline_here):
    """Before, a print in the factory's file came first on stdout: `predict --json | jq` read no JSON."""
    (tmp_path / "tiny.py").write_text('print("building the model")\n' + FACTORY)
    result = redline_here("predict", spec, "--input", samples(tmp_path, np.ones((3, 3), np.float32)), "--output",
                          str(tmp_path / "y.npy"), "--precision", "fp32", "--compile", "off", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["samples"] == 3 and "building the model\n" in result.stderr


@pytest.mark.parametrize("stdout", ["/dev/stdout", "-"])  # "-" wrote a file named "-"
def test_outputs_written_to_stdout_are_the_array_alone_the_plan_and_summary_going_to_stderr(tmp_path, spec, stdout):
    # redline predict ... --output /dev/stdout | consumer: the plan table printed on stdout went into the array
    inputs = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    command = [sys.executable, "-m", "redline", "predict", spec, "--input", samples(tmp_path, inputs), "--output",
               stdout, "--precision", "fp32", "--compile", "off"]  # fmt: skip
    environ = {name: value for name, value in os.environ.items() if name != "COLUMNS"}  # stderr is a pipe: no width
    result = subprocess.run(command, capture_output=True, timeout=300, env=environ)
    assert result.returncode == 0, result.stderr.decode()
    written = np.load(io.BytesIO(result.stdout))  # the whole of stdout is one .npy array
    with torch.no_grad():
        plain = load_servable(spec).model(torch.from_numpy(inputs)).numpy()
    np.testing.assert_allclose(written, plain, rtol=0, atol=1e-6)
    assert b"precision" in result.stderr and b"5 samples in" in result.stderr
    summary = next(line for line in result.stderr.decode().splitlines() if line.startswith("5 samples in"))
    assert summary.endswith(" -> /dev/stdout") and len(summary) > 80, "one line, not broken at 80 columns"
    both = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=300, env={**os.environ})
    assert both.returncode == 2 and both.stdout == ""
    assert both.stderr.startswith("error: --output '/dev/stdout' is stdout, where --json prints too")
    assert not os.path.exists("-"), "a file named - was written"


@pytest.mark.parametrize("stdout", ["/dev/stdout", "-"])
def test_outputs_to_stdout_on_a_terminal_are_refused_before_the_model_loads(tmp_path, spec, stdout):
    """The .npy bytes printed on a terminal (which alters them, too), where a pipe or a file was meant."""
    pty = pytest.importorskip("pty")
    leader, follower = pty.openpty()
    try:
        command = [sys.executable, "-m", "redline", "predict", spec, "--input", samples(tmp_path, np.ones((2, 3))),
                   "--output", stdout]  # fmt: skip
        result = subprocess.run(command, stdout=follower, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(follower)
        os.close(leader)
    assert result.returncode == 2
    assert result.stderr.startswith("error: --output '/dev/stdout' is stdout, which is a terminal"), result.stderr
    assert "hint: pipe it" in result.stderr and "building the model" not in result.stderr


def test_output_dash_on_a_system_without_dev_stdout_is_refused_by_its_flag(tmp_path, spec, monkeypatch):
    exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self: False if str(self) == "/dev/stdout" else exists(self))
    result = predict(spec, "--input", samples(tmp_path, np.ones((2, 3))), "--output", "-")
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        "--output='-' is not allowed; expected a file: this system has no /dev/stdout\n"
        "hint: name a file, e.g. outputs.npy"
    )


def test_a_batch_size_beyond_the_samples_warms_up_no_bucket_larger_than_the_file(tmp_path, spec, monkeypatch):
    built = []

    def engine(*args, **kwargs):
        built.append(kwargs["max_batch_size"])
        return InferenceEngine(*args, **kwargs)

    monkeypatch.setattr(predict_module, "InferenceEngine", engine)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((3, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--batch-size", "65536", "--precision", "fp32",
                     "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert built == [3], "the buckets up to 65536 would each run once on zeros"
    assert np.load(tmp_path / "y.npy").shape == (3, 2)


def test_every_row_runs_in_one_bucket_so_a_sample_gets_the_same_outputs_in_any_row(tmp_path, spec, monkeypatch):
    """With a server's buckets, the last partial batch ran on the smaller buckets, which a measured plan may split
    off to another setting (fp32 beside bf16): one sample repeated 33 times gave row 32 other logits."""
    made = []

    def engine(*args, **kwargs):
        made.append((kwargs.get("batch_buckets"), kwargs.get("planned_batches")))
        return InferenceEngine(*args, **kwargs)

    monkeypatch.setattr(predict_module, "InferenceEngine", engine)
    one = np.random.default_rng(0).normal(size=(1, 3)).astype(np.float32)
    result = predict(spec, "--input", samples(tmp_path, np.repeat(one, 9, axis=0)), "--output", str(tmp_path / "y.npy"),
                     "--batch-size", "4", "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert made == [((4,), 3)], "one bucket, and the job's length: 3 batches of 4 for 9 rows"
    written = np.load(tmp_path / "y.npy")
    assert (written == written[0]).all()


def test_a_wrong_sample_shape_exits_2_naming_expected_and_got(tmp_path, spec, redline_here):
    bad = samples(tmp_path, np.zeros((5, 4), np.float32))
    result = redline_here("predict", spec, "--input", bad, "--output", str(tmp_path / "y.npy"))
    assert result.returncode == 2
    assert "samples of shape (4,)" in result.stderr and "expected (N, 3)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "y.npy").exists()


@pytest.mark.parametrize(
    ("shape", "said", "hint"),
    [((3,), "the array (3,) is one sample of tiny's input shape, without the batch dimension; expected (N, 3)",
      "hint: save it as a batch of one: numpy.save(path, array[None])"),
     ((5, 1, 3), "samples of shape (1, 3) (array (5, 1, 3)) do not fit tiny; expected (N, 3)",
      "hint: each row holds one sample's values; add or drop its axes of size 1: "
      "numpy.save(path, array.reshape(-1, 3))"),
     ((12,), "the array (12,) is flat (one value a sample) and does not fit tiny; expected (N, 3)",
      "hint: the first dimension counts the samples; each sample has the model's input shape; the array holds the "
      "values of 4 such samples: numpy.save(path, array.reshape(-1, 3)), if they are in order"),
     ((4, 2), "samples of shape (2,) (array (4, 2)) do not fit tiny; expected (N, 3)",
      "hint: the first dimension counts the samples; each sample has the model's input shape")],
    ids=["one-sample", "extra-axis", "flat", "short-rows"],
)  # fmt: skip
def test_an_array_that_is_one_sample_or_a_reshape_away_is_told_the_fix(tmp_path, spec, shape, said, hint):
    result = predict(spec, "--input", samples(tmp_path, np.zeros(shape, np.float32)), "--output",
                     str(tmp_path / "y.npy"))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    assert str(result.exception) == f"--input {str(tmp_path / 'x.npy')!r}: {said}\n{hint}"
    assert "samples of shape ()" not in str(result.exception)


def test_flattened_samples_are_told_the_reshape_and_its_caveat(tmp_path):
    (tmp_path / "image.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\ndef make():\n"
        "    return Servable(model=nn.Flatten(), input_shape=(1, 2, 2), name='image')\n"
    )
    result = predict(f"{tmp_path / 'image.py'}:make", "--input", samples(tmp_path, np.zeros((5, 4), np.float32)),
                     "--output", str(tmp_path / "y.npy"))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    message = str(result.exception)
    assert "samples of shape (4,) (array (5, 4)) do not fit image; expected (N, 1, 2, 2)" in message
    assert "numpy.save(path, array.reshape(-1, 1, 2, 2)), if they are in the model's order" in message
    assert "need array.transpose first" in message


def truncate(path):
    path.write_bytes(path.read_bytes()[:-8])
    return str(path)


@pytest.mark.parametrize(
    ("make_input", "message"),
    [
        (lambda d: str(d / "missing.npy"), "does not exist"),
        (lambda d: str(d), "is a directory\nhint: name the .npy file"),
        (lambda d: os.mkfifo(d / "pipe.npy") or str(d / "pipe.npy"), "is a pipe or a device, not a file"),
        (lambda d: (d / "t.txt").write_text("1,2,3") and str(d / "t.txt"), "is not a .npy file"),
        (lambda d: np.savez(d / "a.npz", x=np.zeros((2, 3))) or str(d / "a.npz"), "is an .npz archive"),
        (lambda d: samples(d, np.zeros((0, 3), np.float32)), "holds no samples"),
        (
            lambda d: samples(d, np.float32(3)),
            "holds one value (shape ()), not samples along a first dimension\n"
            "hint: the first dimension counts the samples: save this one as "
            "numpy.save(path, array[None])",
        ),
        (lambda d: samples(d, np.zeros((2, 3), np.complex64)), "every sample: inputs are complex numbers (complex64)"),
        (lambda d: samples(d, np.full((2, 3), "a")), "x.npy': every sample: inputs are text (<U1)\nhint: "),
        (lambda d: samples(d, np.zeros((2, 3), [("a", "f4")])), "inputs are records of fields ([('a', '<f4')])"),
        (lambda d: samples(d, np.array([[0, 1, 2], [0, np.nan, 2]], np.float64)), "row 1 (the first that fails)"),
        (lambda d: samples(d, np.full((1, 3), 1e300)), "beyond ±3.40282e+38"),
        (lambda d: samples(d, np.array([[1.0], [1.0, 2.0]], dtype=object)), "equal-sized rows"),
        (lambda d: samples(d, np.zeros((4, 3), np.float32)) and truncate(d / "x.npy"), "may be truncated"),
    ],
)
def test_a_bad_input_is_a_clear_error_and_writes_nothing(tmp_path, spec, make_input, message):
    result = predict(spec, "--input", make_input(tmp_path), "--output", str(tmp_path / "y.npy"))
    assert result.exit_code != 0
    assert isinstance(result.exception, ConfigError) and message in str(result.exception)
    assert "hint:" in str(result.exception) or "no samples" in message
    assert not (tmp_path / "y.npy").exists()


def test_a_bad_value_deep_in_a_large_input_is_named_by_its_row(tmp_path, spec):
    inputs = np.zeros((predict_module.CHECK_CHUNK * 2 + 10, 3), np.float32)
    inputs[5000, 1] = np.inf
    inputs[7000, 0] = np.nan
    result = predict(spec, "--input", samples(tmp_path, inputs), "--output", str(tmp_path / "y.npy"))
    assert isinstance(result.exception, ConfigError)
    assert "x.npy': row 5000 (the first that fails): inputs hold values that are not finite" in str(result.exception)


def test_a_big_endian_array_is_read_as_its_values(tmp_path, spec):
    inputs = np.arange(6, dtype=">f4").reshape(2, 3)  # as numpy.save writes on a big-endian machine
    out = tmp_path / "y.npy"
    result = predict(spec, "--input", samples(tmp_path, inputs), "--output", str(out), "--precision", "fp32",
                     "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        expected = load_servable(spec).model(torch.from_numpy(inputs.astype(np.float32))).numpy()
    np.testing.assert_allclose(np.load(out), expected, rtol=0, atol=1e-6)


def test_a_large_big_endian_input_is_converted_batch_by_batch_not_loaded_whole(tmp_path, spec):
    import tracemalloc

    path = tmp_path / "large.npy"
    np.save(path, np.ones((4_000_000, 3), ">f4"))  # 48 MB, as numpy.save writes on a big-endian machine
    tracemalloc.start()
    try:
        loaded = predict_module.read_samples(path)
        predict_module.check_samples(loaded, load_servable(spec), path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB held to read a 48 MB input: it was converted whole"
    emitted = []
    engine = InferenceEngine(load_servable(spec), device="cpu", precision="fp32", compile="off", max_batch_size=4)
    predict_module.run_batches(engine, loaded[:10], 4, "--input", "check", emitted.append)
    assert np.array_equal(np.concatenate(emitted), engine.predict(np.ones((10, 3), np.float32)).numpy())


def test_a_missing_output_directory_is_created_as_train_and_bench_create_theirs(tmp_path, spec):
    out = tmp_path / "runs" / "today" / "y.npy"
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(out),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (2, 2)


def test_an_output_under_a_file_is_refused_before_the_model_loads_and_the_file_kept(tmp_path, spec):
    (tmp_path / "notes").write_text("mine")
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "notes" / "sub" / "y.npy"))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.output
    assert f"expected a file in a directory; {tmp_path / 'notes'} is a file" in str(result.exception)
    assert (tmp_path / "notes").read_text() == "mine" and "Predicting with" not in result.output


def test_a_missing_input_leaves_no_output_directory_made_for_nothing(tmp_path, spec):
    result = predict(spec, "--input", str(tmp_path / "missing.npy"), "--output", str(tmp_path / "out" / "y.npy"))
    assert isinstance(result.exception, ConfigError) and "does not exist" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_an_output_directory_that_cannot_be_written_is_refused_before_the_model_runs(tmp_path, spec, monkeypatch):
    def read_only(*args, **kwargs):  # what creating a file in a read-only directory raises (root would pass)
        raise PermissionError(13, "Permission denied")

    inputs = samples(tmp_path, np.zeros((2, 3), np.float32))
    monkeypatch.setattr("redline.atomic._temporary_beside", read_only)
    out = tmp_path / "y.npy"
    result = predict(spec, "--input", inputs, "--output", str(out))
    assert isinstance(result.exception, ConfigError), result.exception
    assert str(result.exception).startswith(
        f"--output={str(out)!r} is not allowed; expected a file you can write (Permission denied)"
    )
    assert "hint: pass a file in a directory you can write to" in str(result.exception)
    assert "Predicting with" not in result.output, "refused before the model was loaded and run"


def test_a_model_failing_midway_is_one_clear_error_naming_its_row_and_leaves_the_old_output(
    tmp_path, spec, redline_here
):
    inputs = np.zeros((6, 3), np.float32)
    inputs[4] = 666  # the third batch of two
    out = tmp_path / "y.npy"
    np.save(out, np.arange(3))  # a previous run's outputs
    result = redline_here("predict", spec, "--input", samples(tmp_path, inputs), "--output", str(out),
                          "--batch-size", "2", "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "the model raised while predicting row 4 of --input" in result.stderr
    assert "(6 rows), which fails alone (rows 4 to 5 ran together): RuntimeError" in result.stderr
    assert "RuntimeError: the model failed on a poisoned sample" in result.stderr
    assert f"at {tmp_path / 'tiny.py'}:" in result.stderr and "in forward: raise RuntimeError(" in result.stderr
    assert "hint: check row 4's values, and that the model takes the Servable's input_shape (3,)" in result.stderr
    assert np.array_equal(np.load(out), np.arange(3)), "the previous output is intact"
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".pyc" and p.name != "__pycache__") == [
        "tiny.py",
        "x.npy",
        "y.npy",
    ], "no temporary file of the output is left"


def test_a_model_that_calls_sys_exit_is_an_error_naming_it_not_a_silent_exit(tmp_path, spec):
    # it exited with the model's code, 4, and printed nothing
    inputs = np.zeros((4, 3), np.float32)
    inputs[3] = 777
    out = tmp_path / "y.npy"
    np.save(out, np.arange(3))
    result = predict(spec.replace(":make", ":exits"), "--input", samples(tmp_path, inputs), "--output", str(out),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert isinstance(result.exception, InferenceError), result.output  # exit 2 through the command line's handler
    said = str(result.exception)
    assert said.startswith("the model raised SystemExit(4) while predicting row 3 of --input") and "fails alone" in said
    assert "in forward: raise SystemExit(4)" in said  # the model's line
    assert np.array_equal(np.load(out), np.arange(3)), "the previous output is intact"
    always = predict(spec.replace(":make", ":always_exits"), "--input", samples(tmp_path, inputs), "--output",
                     str(out), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert isinstance(always.exception, InferenceError), always.output  # in the warm-up
    assert str(always.exception).startswith("the model raised SystemExit(4) while warming up, before any row")


def test_a_model_that_fails_on_the_declared_input_shape_is_told_at_the_warm_up(tmp_path, spec):
    result = predict(spec.replace(":make", ":misdeclared"), "--input", samples(tmp_path, np.zeros((5, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert isinstance(result.exception, InferenceError), result.exception
    message = str(result.exception)
    assert message.startswith("the model raised while warming up, before any row of --input ran")
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in message
    assert "in forward: return self.linear(x)" in message
    assert "check that the model takes the Servable's input_shape (3,) and input_dtype float32" in message
    assert not (tmp_path / "y.npy").exists()


def test_a_model_output_the_engine_cannot_serve_is_told_with_what_was_running(tmp_path, spec):
    result = predict(spec.replace(":make", ":pairs"), "--input", samples(tmp_path, np.zeros((5, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert isinstance(result.exception, InferenceError), result.exception
    assert str(result.exception) == (
        "while warming up, before any row of --input ran (on zeros of the Servable's input shape): the model "
        "returned a tuple of 2 values: tensor (5, 3), tensor (5, 3); the engine serves models that return one tensor\n"
        "hint: serve a module whose forward returns the one tensor meant: a wrapper whose forward(x) returns "
        "self.model(x)[0]"
    )


def test_redlines_own_code_failing_is_not_blamed_on_the_model(tmp_path, spec, monkeypatch):
    # A builtin in place of the engine's helper fails in the engine's own frame, as a bug of redline's would.
    monkeypatch.setattr(engine_module, "bucket_for", max)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((5, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert type(result.exception) is TypeError, result.exception  # the command ends with its traceback
    assert traceback.extract_tb(result.exception.__traceback__)[-1].filename == engine_module.__file__
    assert "the model raised" not in result.output
    assert not (tmp_path / "y.npy").exists()


def test_a_tasks_model_loaded_without_weights_is_said_to_be_untrained(tmp_path, caplog):
    from safetensors.torch import save_model

    save_model(load_servable("example:digits").model, str(tmp_path / "model.safetensors"))
    caplog.clear()
    load_servable("example:digits", weights=tmp_path / "model.safetensors")
    assert caplog.messages == []
    load_servable("example:digits")
    assert len(caplog.messages) == 1 and caplog.messages[0].startswith("task 'digits': no --weights given")
    assert "untrained" in caplog.messages[0]
    torch.manual_seed(5)
    state = torch.random.get_rng_state()
    again = load_servable("example:digits").model.state_dict()
    assert all(torch.equal(v, again[k]) for k, v in load_servable("example:digits").model.state_dict().items()), (
        "the untrained model is the same on every start"
    )
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's random state is left alone"


def test_weights_that_are_not_a_safetensors_file_are_one_clear_error(tmp_path, spec):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"not a safetensors file at all")
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    assert f"--weights {str(weights)!r}" in str(result.exception) and "hint:" in str(result.exception)
    assert not (tmp_path / "y.npy").exists()


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy-pickle"])
def test_weights_written_by_torch_save_are_told_as_such_with_the_conversion(tmp_path, spec, zipped):
    weights = tmp_path / "model.pt"
    state = load_servable(spec).model.state_dict()
    torch.save(state, weights, _use_new_zipfile_serialization=zipped)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    message = str(result.exception)
    assert message.startswith(f"--weights {str(weights)!r} was written by torch.save (a pickle), not safetensors")
    assert "header" not in message, "safetensors' own words (a header too large) say nothing of what the file is"
    command = message.split('python -c "')[1].split('"')[0]  # the conversion the hint gives works as written
    subprocess.run([sys.executable, "-c", command], cwd=tmp_path, check=True)
    converted = tmp_path / "model.safetensors"
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(converted), "--precision", "fp32",
                     "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_weights_of_another_model_are_refused_naming_the_tensors_that_differ(tmp_path, spec):
    from safetensors.torch import save_file

    weights = tmp_path / "model.safetensors"
    other = {"linear.weight": torch.zeros(2, 4), "linear.bias": torch.zeros(2), "head.weight": torch.zeros(1)}
    save_file(other, weights)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    message = str(result.exception)
    assert message.startswith(f"--weights {str(weights)!r} does not fit the model Poisoned: ")
    assert "not in this model: head.weight" in message
    assert "shapes differ: linear.weight ([2, 4] in the checkpoint, [2, 3] in this model)" in message
    assert "hint: pass the weights written by a run of this same model" in message


def test_weights_given_as_a_run_directory_load_the_final_weights_inside(tmp_path, spec):
    from safetensors.torch import save_model

    run = tmp_path / "run"
    run.mkdir()
    save_model(load_servable(spec).model, str(run / "model.safetensors"))
    given = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                    "--output", str(tmp_path / "y.npy"), "--weights", str(run))  # fmt: skip
    assert given.exit_code == 0, given.output
    inside = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "z.npy"), "--weights", str(run / "model.safetensors"))  # fmt: skip
    assert inside.exit_code == 0, inside.output
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), np.load(tmp_path / "z.npy"))


@pytest.mark.parametrize("weights", ["run", "run/model.safetensors"])
def test_weights_of_a_run_that_stopped_before_writing_them_name_its_newest_checkpoints(tmp_path, spec, weights):
    # A killed run's --out holds checkpoints and no model.safetensors: the hint named only what a finished run writes
    import torch

    import redline

    with redline.Runtime(devices="cpu", compile="off") as rt:
        rt.setup(load_servable(spec).model, lambda params: torch.optim.SGD(params, lr=0.1))
        for step in (3, 7):
            rt.save(tmp_path / "run" / "checkpoints" / f"step-{step:08d}", step=step)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(tmp_path / weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    newest = tmp_path / "run" / "checkpoints" / "step-00000007" / "model.safetensors"
    assert str(result.exception).endswith(
        f"\nhint: the run stopped before writing its final weights; its newest checkpoint holds those of step 7: "
        f"--weights {newest}"
    )
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(newest))  # fmt: skip
    assert result.exit_code == 0, result.output


def test_a_runs_final_weights_that_it_went_on_past_are_refused_naming_both_steps(tmp_path, spec):
    """A run stopped at step 5 wrote its final weights; resumed, it checkpointed step 9 and was killed: --weights RUN
    loaded the older final weights without a word."""
    import torch

    import redline

    run = tmp_path / "run"
    model = load_servable(spec).model
    with redline.Runtime(devices="cpu", compile="off") as rt:
        rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(run / "checkpoints" / "step-00000005", step=5)
    save_model(model, str(run / "model.safetensors"))
    (run / "summary.json").write_text(json.dumps({"task": "t", "steps": 5}))
    given = ["--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(tmp_path / "y.npy")]
    assert predict(spec, *given, "--weights", str(run)).exit_code == 0  # its newest checkpoint is its final step's
    with redline.Runtime(devices="cpu", compile="off") as rt:
        rt.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(run / "checkpoints" / "step-00000009", step=9)  # the resumed run, killed after it
    result = predict(spec, *given, "--weights", str(run))
    newest = run / "checkpoints" / "step-00000009" / "model.safetensors"
    assert isinstance(result.exception, ConfigError) and str(result.exception) == (
        f"--weights {str(run)!r}: its model.safetensors holds the weights of step 5 (its summary.json), but the run "
        "went on past them: its newest checkpoint holds those of step 9 (resumed, then stopped before it ended, or "
        f"still going)\nhint: pass the ones you mean: --weights {newest} (step 9), or --weights "
        f"{run / 'model.safetensors'} (step 5)"
    )
    assert predict(spec, *given, "--weights", str(run / "model.safetensors")).exit_code == 0  # the file itself: taken
    typo = predict(spec, *given, "--weights", str(run / "model.safetenors"))
    assert str(typo.exception).endswith(
        f"\nhint: its newest checkpoint holds those of step 9: --weights {newest} (the run's final weights, of an "
        f"earlier step, are {run / 'model.safetensors'})"
    )


def test_a_mistyped_file_in_a_finished_run_is_pointed_at_its_final_weights(tmp_path, spec):
    import torch

    import redline

    run = tmp_path / "run"
    with redline.Runtime(devices="cpu", compile="off") as rt:
        rt.setup(load_servable(spec).model, lambda params: torch.optim.SGD(params, lr=0.1))
        rt.save(run / "checkpoints" / "step-00000003", step=3)
    save_model(load_servable(spec).model, str(run / "model.safetensors"))
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(run / "nope.safetensors"))  # fmt: skip
    newest = run / "checkpoints" / "step-00000003" / "model.safetensors"
    assert str(result.exception).endswith(  # it had said the run stopped before writing them
        f"\nhint: the run's final weights: --weights {run} (its newest checkpoint holds those of step 3: --weights "
        f"{newest})"
    )


def test_the_summary_names_the_output_file_as_written(tmp_path, spec):
    out = tmp_path / "y[run1].npy"
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(out),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert out.is_file() and "y[run1].npy" in result.output.replace("\n", "")


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--precision", "fp8", "--precision='fp8' is not allowed; expected one of 'auto', 'fp32'"),
        ("--compile", "maybe", "--compile='maybe' is not allowed; expected one of 'auto', 'on', 'off'"),
        (
            "--cuda-graphs",
            "yes",
            "--cuda-graphs='yes' is not allowed; expected one of 'auto', 'on', 'off'\nhint: did "
            "you mean --cuda-graphs 'on'?",
        ),
        ("--cuda-graphs", "on", "--cuda-graphs='on' is not allowed; expected 'auto' or 'off' on cpu"),
        ("--measure", "always", "--measure='always' is not allowed; expected 'auto' or 'off'"),
        ("--device", "tpu", "--device='tpu' is not allowed; expected 'auto', 'cpu'"),
    ],
)
@pytest.mark.parametrize("command", ["serve", "predict"])
def test_a_bad_engine_flag_is_named_by_its_flag_before_the_model_loads(
    tmp_path, monkeypatch, command, flag, value, said
):
    monkeypatch.setattr(predict_module, "load_given_servable", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr("redline.cli.serve.load_given_servable", lambda *a, **k: pytest.fail("the model was loaded"))
    where = ["--port", "0"] if command == "serve" else ["--input", samples(tmp_path, np.zeros((2, 3), np.float32))]
    where += [] if command == "serve" else ["--output", str(tmp_path / "y.npy")]
    args = [command, "example:digits", *where, "--device", "cpu", flag, value]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(said), str(result.exception)
    assert "_" not in str(result.exception).split(" is not allowed")[0], "said by the argument's Python name"


def test_an_output_that_is_a_pipe_or_a_device_is_written_into_not_replaced_by_a_file(tmp_path, spec):
    pipe = tmp_path / "outputs.pipe"  # as /dev/null is: renamed over as root, it became a regular file for everyone
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)  # a consumer already reading, as `--output >(cmd)` has
    try:
        inputs = np.ones((2, 3), np.float32)
        result = predict(spec, "--input", samples(tmp_path, inputs), "--output", str(pipe), "--precision", "fp32",
                         "--compile", "off")  # fmt: skip
        assert result.exit_code == 0, result.output
        assert stat.S_ISFIFO(pipe.stat().st_mode), "the pipe was replaced by a regular file"
        written = os.read(reader, 1 << 16)
    finally:
        os.close(reader)
    with torch.no_grad():
        expected = load_servable(spec).model(torch.from_numpy(inputs)).numpy()
    np.testing.assert_allclose(np.load(io.BytesIO(written)), expected, rtol=0, atol=1e-6)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "no temporary file was left"


@pytest.mark.parametrize("linked", [False, True])
def test_an_output_that_is_the_input_file_is_refused_and_the_samples_are_kept(tmp_path, spec, linked):
    inputs = samples(tmp_path, np.ones((2, 3), np.float32))
    out = tmp_path / "alias.npy" if linked else inputs
    if linked:
        out.symlink_to(inputs)
    result = predict(spec, "--input", inputs, "--output", str(out))
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception).startswith(f"--output {str(out)!r} is the --input file"), result.exception
    assert "hint: write the outputs to another file" in str(result.exception)
    assert np.array_equal(np.load(inputs), np.ones((2, 3), np.float32)), "the samples were overwritten"


def test_a_large_input_is_read_from_disk_batch_by_batch_not_loaded_whole(tmp_path, spec):
    import tracemalloc

    path = tmp_path / "large.npy"
    np.save(path, np.ones((4_000_000, 3), np.float32))  # 48 MB on disk
    servable = load_servable(spec)
    tracemalloc.start()
    try:
        loaded = predict_module.read_samples(path)
        predict_module.check_samples(loaded, servable, path)
        first = np.asarray(loaded[:32])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert loaded.shape == (4_000_000, 3) and np.array_equal(first, np.ones((32, 3), np.float32))
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB held to read a 48 MB input"
    small = samples(tmp_path, np.ones((5, 3), np.float32), name="small.npy")  # read through the map as well
    result = subprocess.run(
        [sys.executable, "-m", "redline", "predict", spec, "--input", small, "--output", str(tmp_path / "y.npy"),
         "--measure", "off"],
        capture_output=True, text=True, timeout=300, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr  # torch's, of a read-only array
    assert np.load(tmp_path / "y.npy").shape == (5, 2)


@pytest.mark.parametrize("command", ["serve", "predict"])
@pytest.mark.parametrize(
    ("given", "message", "hint"),
    [
        ("digits", "model spec 'digits' has no ':'", "the built-in example is 'example:digits'"),
        ("example:digit", "model spec 'example:digit': no built-in example 'digit'", "did you mean 'example:digits'"),
        ("{dir}/tiny.py", "model spec '{dir}/tiny.py' has no ':'",
         "name the function that returns the Servable (or a Task), one of: make, misdeclared"),
        ("{dir}/tiny.py:nothing", "model spec '{dir}/tiny.py:nothing': ", None),
        ("{dir}/tiny.py:make size=3", "model spec '{dir}/tiny.py:make': unknown option(s) size", None),
        ("{dir}/tiny.py:broken", "model spec '{dir}/tiny.py:broken': the factory raised RuntimeError: no checkpoint",
         "the error is in the model factory's own code, at the line shown"),
    ],
)  # fmt: skip
def test_serve_and_predict_name_the_spec_the_user_typed_a_model_spec(tmp_path, spec, command, given, message, hint):
    given, _, task_arg = given.format(dir=tmp_path).partition(" ")
    message, hint = message.format(dir=tmp_path), (hint or "").format(dir=tmp_path)
    args = ["--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(tmp_path / "y.npy")]
    task_args = ["--task-arg", task_arg] if task_arg else []
    result = CliRunner().invoke(app, [command, given, *task_args, *(args if command == "predict" else ["--port", "0"])])
    error = str(result.exception)
    assert isinstance(result.exception, TaskSpecError) and error.startswith(message), error
    assert not hint or f"\nhint: {hint}" in error, error
    assert "task spec" not in error and "task's" not in error


def test_outputs_that_change_shape_between_batches_are_one_clear_error_at_that_batch(tmp_path):
    (tmp_path / "square.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\nclass Square(nn.Module):\n"
        "    def forward(self, x):\n        return x.new_zeros((len(x), 4 if bool((x == 0).all()) else 2))\n\n\n"
        "def make():\n    return Servable(model=Square(), input_shape=(3,), name='square')\n"
    )
    out, rows = tmp_path / "y.npy", np.zeros((6, 3), np.float32)
    rows[4:] = 1  # the second batch: 4 wide no more
    result = predict(f"{tmp_path / 'square.py'}:make", "--input", samples(tmp_path, rows),
                     "--output", str(out), "--batch-size", "4", "--compile", "off")  # fmt: skip
    assert isinstance(result.exception, InferenceError), result.exception  # not numpy's ValueError, after the last
    message = str(result.exception)
    assert message.startswith(
        f"the model's outputs changed shape while predicting rows 4 to 5 of --input {str(tmp_path / 'x.npy')!r}: "
        "(2,) per sample, where the rows before gave (4,)"
    )
    assert "hint: give every sample's output one shape, whatever the batch" in message
    assert not out.exists()


def test_outputs_that_change_dtype_between_batches_are_one_clear_error_not_cast(tmp_path):
    """Before, later batches were cast to the first's dtype: float logits written as integers, exit 0."""
    (tmp_path / "vary.py").write_text(
        "import torch\nfrom torch import nn\nfrom redline.serve.servable import Servable\n\n\n"
        "class Vary(nn.Module):\n    def forward(self, x):\n"
        "        return x.long() if bool((x == 0).all()) else x * 0.5  # integers for the zero rows alone\n\n\n"
        "def make():\n    return Servable(model=Vary(), input_shape=(3,), name='vary')\n"
    )
    rows = np.ones((8, 3), np.float32)
    rows[:4] = 0
    out = tmp_path / "y.npy"
    result = predict(f"{tmp_path / 'vary.py'}:make", "--input", samples(tmp_path, rows), "--output", str(out),
                     "--batch-size", "4", "--compile", "off", "--measure", "off")  # fmt: skip
    assert isinstance(result.exception, InferenceError), result.output
    assert str(result.exception).startswith(
        f"the model's outputs changed dtype while predicting rows 4 to 7 of --input {str(tmp_path / 'x.npy')!r}: "
        "float32, where the rows before gave int64"
    )
    assert not out.exists()


@pytest.mark.parametrize("kept", ["weights", "code"])
def test_an_output_that_is_the_weights_or_the_models_code_is_refused_and_the_file_kept(tmp_path, spec, kept):
    """Before, --output model.safetensors (or the factory's own .py) replaced it with the outputs, exit 0."""
    weights = tmp_path / "w.safetensors"
    save_model(load_servable(spec).model, str(weights))
    target = weights if kept == "weights" else tmp_path / "tiny.py"
    before = target.read_bytes()
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--weights", str(weights),
                     "--output", str(target))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.output
    named = "the --weights file: the outputs would replace the model's weights" if kept == "weights" else (
        f"the file of {spec}: the outputs would replace the model's code"
    )  # fmt: skip
    assert str(result.exception).startswith(f"--output {str(target)!r} is {named}\nhint: write the outputs")
    assert target.read_bytes() == before


def test_an_output_holding_a_file_that_is_no_npy_array_is_refused_before_the_model_loads_and_kept(tmp_path, spec):
    """Before, --output another run's model.safetensors (--weights and --output swapped) replaced it, exit 0."""
    other = tmp_path / "run" / "model.safetensors"
    other.parent.mkdir()
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(other))
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        f"--output={str(other)!r} is not allowed; expected a new file, or an earlier .npy array to replace; this one "
        f"holds something else\nhint: name another file, e.g. --output={str(other.parent / 'outputs.npy')!r}, or "
        f"delete {str(other)!r} first"
    )
    assert other.read_bytes() == b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    assert "Predicting with" not in result.output


def test_an_earlier_npy_output_is_replaced(tmp_path, spec):
    out = tmp_path / "y.npy"
    np.save(out, np.arange(3))  # a previous run's outputs
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)), "--output", str(out),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (2, 2)


def test_an_output_ending_with_a_slash_is_refused_as_a_directory_not_written_as_a_file(tmp_path, spec):
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", f"{tmp_path / 'results'}/")  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        f"--output={str(tmp_path / 'results') + '/'!r} is not allowed; expected a file, not a directory (it ends "
        f"with /)\nhint: name a file in it, e.g. {tmp_path / 'results'}/outputs.npy"
    )
    assert not (tmp_path / "results").exists()


def test_one_row_with_a_fraction_for_an_integer_model_is_named_not_every_sample(tmp_path):
    (tmp_path / "tokens.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\ndef make():\n"
        "    return Servable(model=nn.Embedding(10, 2), input_shape=(3,), input_dtype='int64', name='tokens')\n"
    )
    rows = np.arange(30.0).reshape(10, 3) % 10  # whole numbers saved as floats: they run as integers
    rows[7, 2] = 2.5
    result = predict(f"{tmp_path / 'tokens.py'}:make", "--input", samples(tmp_path, rows),
                     "--output", str(tmp_path / "y.npy"))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    assert str(result.exception) == (
        f"--input {str(tmp_path / 'x.npy')!r}: row 7 (the first that fails): inputs hold values that are not whole "
        "numbers (a fraction, NaN or infinity), where int64 takes integers\n"
        "hint: save the array as int64 values the model can take"
    )


def test_weights_saved_from_a_wrapped_model_are_told_the_prefix_and_the_rename(tmp_path, spec):
    from safetensors.torch import save_file

    weights = tmp_path / "ddp.safetensors"
    state = load_servable(spec).model.state_dict()
    save_file({f"module.{name}": tensor for name, tensor in state.items()}, weights)  # as DDP's state_dict names them
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    hint = str(result.exception).split("\nhint: ")[1]
    assert hint.startswith("the file's names all start with 'module.' (a model saved wrapped: DDP's 'module.',")
    subprocess.run([sys.executable, "-c", hint.split('python -c "')[1][:-1]], cwd=tmp_path, check=True)
    result = predict(spec, "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(tmp_path / "model.safetensors"),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output


def test_weights_for_a_model_the_factory_wrapped_say_to_serve_the_plain_model(tmp_path, spec):
    from safetensors.torch import save_file

    (tmp_path / "wrapped.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\nclass Wrapper(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.module = nn.Linear(3, 2)\n\n"
        "    def forward(self, x):\n        return self.module(x)\n\n\n"
        "def make():\n    return Servable(model=Wrapper(), input_shape=(3,), name='wrapped')\n"
    )
    weights = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, weights)
    result = predict(f"{tmp_path / 'wrapped.py'}:make", "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"), "--weights", str(weights))  # fmt: skip
    assert isinstance(result.exception, ConfigError), result.exception
    assert str(result.exception).endswith(
        "hint: the model's names all start with 'module.', the file's do not: the factory wraps the model "
        "(torch.compile, DDP); give the Servable the plain model (the engine compiles it itself, --compile)"
    )


DICT_INPUTS = """
import torch
from torch import nn
from redline.serve.servable import Servable


class Classifier(nn.Module):
    \"\"\"A Hugging Face-style model: its forward takes a dict of tensors and returns one.\"\"\"

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, batch):
        mask = batch["attention_mask"].unsqueeze(-1).float()
        pooled = (self.embed(batch["input_ids"]) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return {"logits": self.head(pooled)}


class IdsOnly(nn.Module):
    \"\"\"Serve the Classifier one tensor of token ids: the dict is built here, the logits returned.\"\"\"

    def __init__(self):
        super().__init__()
        self.inner = Classifier()

    def forward(self, input_ids):
        return self.inner({"input_ids": input_ids, "attention_mask": (input_ids != 0).long()})["logits"]


def make():
    return Servable(model=IdsOnly(), input_shape=(5,), input_dtype="int64", name="ids")
"""


def test_weights_of_the_model_a_wrapper_holds_load_into_it_and_say_so(tmp_path, caplog):
    """Before, the trained Classifier's weights (its names without the wrapper's 'inner.') were refused, with a hint
    to serve the plain model, which takes a dict the engine cannot pass."""
    (tmp_path / "ids.py").write_text(DICT_INPUTS)
    caplog.set_level(logging.INFO, logger="redline")
    torch.manual_seed(1)
    trained = runpy.run_path(str(tmp_path / "ids.py"))["Classifier"]()
    save_model(trained, str(tmp_path / "model.safetensors"))  # as redline train --out writes it: plain model's names
    ids = np.random.default_rng(0).integers(0, 10, size=(6, 5))
    result = predict(f"{tmp_path / 'ids.py'}:make", "--input", samples(tmp_path, ids), "--output",
                     str(tmp_path / "y.npy"), "--weights", str(tmp_path / "model.safetensors"),
                     "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output
    tokens = torch.as_tensor(ids)
    with torch.no_grad():
        expected = trained({"input_ids": tokens, "attention_mask": (tokens != 0).long()})["logits"]
    torch.testing.assert_close(torch.as_tensor(np.load(tmp_path / "y.npy")), expected)
    assert any(
        message.endswith("'inner' (Classifier), every name of the model being one of the file's with 'inner.' "
                         "before it: loaded into it")
        for message in caplog.messages
    ), caplog.messages  # fmt: skip


def test_outputs_go_to_disk_batch_by_batch_not_held_whole(tmp_path):
    import tracemalloc

    (tmp_path / "same.py").write_text(
        "from torch import nn\nfrom redline.serve.servable import Servable\n\n\ndef make():\n"
        "    return Servable(model=nn.Identity(), input_shape=(64,), name='same')\n"
    )
    spec, out = f"{tmp_path / 'same.py'}:make", tmp_path / "y.npy"
    run = ("--output", str(out), "--batch-size", "4096", "--precision", "fp32", "--compile", "off", "--measure", "off")
    assert predict(spec, "--input", samples(tmp_path, np.ones((3, 64), np.float32), "few.npy"), *run).exit_code == 0
    inputs = np.random.default_rng(0).random((131_072, 64), dtype=np.float32)  # 32 MiB of outputs, as of inputs
    big = samples(tmp_path, inputs, "big.npy")
    del inputs
    tracemalloc.start()  # numpy's arrays are traced (torch's own allocations are not)
    try:
        result = predict(spec, "--input", big, *run)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.exit_code == 0, result.output
    assert peak < 8 * 2**20, f"{peak / 2**20:.0f} MiB held for 32 MiB of outputs: they were gathered, then written"
    written = np.load(out, mmap_mode="r")
    assert written.shape == (131_072, 64) and np.array_equal(written, np.load(big, mmap_mode="r"))


TASKS = """
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

import redline


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(8):
            yield torch.full((3,), float(i)), i % 2


class Records(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"x": torch.zeros(3), "y": 0}


class Missing(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise FileNotFoundError("shard-0.pt")


def task(data):
    torch.manual_seed(0)
    return redline.Task(name=type(data).__name__.lower(), model=nn.Linear(3, 2), loss_fn=nn.functional.cross_entropy,
                        train_data=data, batch_size=4)


def stream():
    return task(Stream())


def records():
    return task(Records())


def missing():
    return task(Missing())


class Inputs(Dataset):  # items whose inputs are made(): a model's several inputs, say
    def __init__(self, made):
        self.made = made

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.made(), 0


def several():
    return task(Inputs(lambda: (torch.zeros(3), torch.zeros(3))))


def uneven():
    return task(Inputs(lambda: (torch.zeros(3), torch.zeros(2))))


def named():
    return task(Inputs(lambda: {"x": torch.zeros(3)}))


def text():
    return task(Inputs(lambda: "a sentence"))


def narrow():
    return task(Inputs(lambda: torch.zeros(3, dtype=torch.bfloat16)))


def learnt():
    return task(Inputs(lambda: torch.zeros(3, requires_grad=True) * 2))


def tokens():
    ids = torch.arange(24, dtype=torch.int16).reshape(6, 4) % 10  # token ids stored narrow, as many corpora are
    return redline.Task(name="tokens", model=nn.Sequential(nn.Embedding(10, 2), nn.Flatten()),
                        loss_fn=nn.functional.cross_entropy, train_data=TensorDataset(ids, ids[:, 0].long()),
                        batch_size=2)
"""


def test_a_task_whose_data_is_a_stream_serves_its_first_items_shape(tmp_path):
    (tmp_path / "tasks.py").write_text(TASKS)
    out = tmp_path / "y.npy"
    result = predict(f"{tmp_path / 'tasks.py'}:stream", "--input", samples(tmp_path, np.ones((5, 3), np.float32)),
                     "--output", str(out), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output  # not a traceback of Dataset.__getitem__'s NotImplementedError
    assert np.load(out).shape == (5, 2)


@pytest.mark.parametrize(
    ("factory", "message"),
    [("records", "task 'records': the first item of train_data is {'x': Tensor(3,) float32, 'y': int 0}, not a pair "
                 "(inputs, targets), so the input shape to serve is unknown\nhint: return (inputs, targets) from"),
     ("missing", "task 'missing': reading the first item of train_data, whose inputs give the served input shape, "
                 "raised FileNotFoundError: shard-0.pt\n  at ")],
)  # fmt: skip
def test_a_task_whose_first_item_gives_no_input_shape_is_one_clear_error(tmp_path, factory, message):
    (tmp_path / "tasks.py").write_text(TASKS)
    result = predict(f"{tmp_path / 'tasks.py'}:{factory}", "--input", samples(tmp_path, np.ones((5, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"))  # fmt: skip
    assert isinstance(result.exception, TaskError), result.exception
    assert str(result.exception).startswith(message), str(result.exception)


@pytest.mark.parametrize(
    ("factory", "found"),
    [("several", "(Tensor(3,) float32, Tensor(3,) float32)"),  # numpy would stack them into one (2, 3) sample
     ("uneven", "(Tensor(3,) float32, Tensor(2,) float32)"), ("named", "{'x': Tensor(3,) float32}"),
     ("text", "str 'a sentence'")],
)  # fmt: skip
def test_a_task_whose_inputs_are_not_one_array_of_numbers_is_one_clear_error(tmp_path, factory, found):
    # a tuple of tensors of two shapes was numpy's ValueError and its traceback; a dict, or text, a scalar float32
    (tmp_path / "tasks.py").write_text(TASKS)
    with pytest.raises(TaskError) as raised:
        load_servable(f"{tmp_path / 'tasks.py'}:{factory}")
    assert str(raised.value) == (
        f"task 'inputs': the inputs of train_data's first item are {found}, not one tensor or array of numbers, so a "
        "request cannot hold them\nhint: have the factory return redline.Servable(model=..., input_shape=(...), "
        "input_dtype=...) around a module that takes one tensor per sample and builds the model's inputs from it, "
        "holding the task's model as a child (self.inner = model): --weights of a run of this task load into that "
        "child"
    )


@pytest.mark.parametrize(("factory", "dtype"), [("narrow", "bfloat16"), ("learnt", "float32")])
def test_a_tasks_tensor_inputs_numpy_cannot_take_are_served_by_their_shape_and_dtype(tmp_path, factory, dtype):
    # bfloat16 has no numpy dtype, and a tensor that requires grad refuses .numpy(): both were tracebacks
    (tmp_path / "tasks.py").write_text(TASKS)
    servable = load_servable(f"{tmp_path / 'tasks.py'}:{factory}")
    assert (servable.input_shape, servable.input_dtype) == ((3,), dtype)


def test_a_tasks_integer_inputs_of_a_dtype_the_server_lacks_are_served_as_int64_not_floats(tmp_path):
    (tmp_path / "tasks.py").write_text(TASKS)
    servable = load_servable(f"{tmp_path / 'tasks.py'}:tokens")
    assert (servable.input_shape, servable.input_dtype) == ((4,), "int64")
    out = tmp_path / "y.npy"
    result = predict(f"{tmp_path / 'tasks.py'}:tokens", "--input", samples(tmp_path, np.arange(12).reshape(3, 4) % 10),
                     "--output", str(out), "--precision", "fp32", "--compile", "off")  # fmt: skip
    assert result.exit_code == 0, result.output  # as float32, the Embedding fails in the warm-up
    assert np.load(out).shape == (3, 8)


def test_the_progress_bar_says_how_long_is_left_not_only_how_long_it_ran(tmp_path, spec, monkeypatch):
    terminal = io.StringIO()
    shown_on = Console(file=terminal, force_terminal=True, width=100)  # a terminal, where the bar shows
    monkeypatch.setattr(predict_module, "Console", lambda stderr: shown_on)
    engine = InferenceEngine(load_servable(spec), device="cpu", precision="fp32", compile="off", max_batch_size=4)
    predict_module.run_batches(engine, np.zeros((40, 3), np.float32), 4, "--input", "check", lambda outputs: None)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.getvalue())  # the terminal's colours and cursor moves
    assert re.search(r"40/40 \d+:\d\d:\d\d left \d+:\d\d:\d\d", shown), shown


def test_a_reader_that_exits_before_the_last_row_is_said_to_have_exited_not_a_full_disk(tmp_path, spec):
    """`--output /dev/stdout | head -c 10` said 'Broken pipe' with a hint to find a disk with room."""
    command = [sys.executable, "-m", "redline", "predict", spec, "--input",
               samples(tmp_path, np.zeros((40_000, 3), np.float32)), "--output", "/dev/stdout", "--precision", "fp32",
               "--compile", "off", "--measure", "off"]  # fmt: skip
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
    assert run.stdout is not None and len(run.stdout.read(10)) == 10
    run.stdout.close()  # as head -c 10 exits
    _, err = run.communicate(timeout=300)
    said = err.decode()
    assert "--output '/dev/stdout' cannot be written: the program reading it exited before every row" in said, said
    assert "on a disk with room" not in said


def test_a_model_spec_naming_no_function_says_what_the_function_returns(tmp_path, spec):
    result = predict(spec.replace(":make", ":nothere"), "--input", samples(tmp_path, np.zeros((2, 3), np.float32)),
                     "--output", str(tmp_path / "y.npy"))  # fmt: skip
    said = str(result.exception)
    assert said.startswith("model spec") and said.endswith("hint: name a function that returns a Servable (or a Task)")
