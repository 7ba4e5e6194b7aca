"""The server's answers to what it reads: outputs for JSON and .npy, every input refusal, body limits, the token."""

import gzip
import logging
import threading

import numpy as np
import pytest
import torch
from serve_client import metrics, npy, ready, reference, running
from serve_engines import FakeEngine, linear_engine
from typer.testing import CliRunner

from redline.cli.main import app
from redline.errors import ConfigError
from redline.serve import app as serve_app
from redline.serve.app import build_app
from redline.serve.engine import InferenceEngine
from redline.serve.options import ServeOptions
from redline.serve.servable import Servable

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_outputs_equal_the_models_own_for_json_and_npy_one_sample_or_many():
    engine = linear_engine()
    inputs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    async with running(engine) as (client, _):
        await ready(client)
        many = await client.post("/v1/predict", json={"inputs": inputs.tolist()})
        one = await client.post("/v1/predict", json={"inputs": inputs[0].tolist()})
        binary = await client.post(
            "/v1/predict", content=npy(inputs.astype(np.float64)), headers={"content-type": "application/octet-stream"}
        )
    expected = reference(engine, inputs)
    assert many.status_code == one.status_code == binary.status_code == 200
    torch.testing.assert_close(torch.tensor(many.json()["outputs"]), expected)
    torch.testing.assert_close(torch.tensor(binary.json()["outputs"]), expected)
    torch.testing.assert_close(torch.tensor(one.json()["outputs"]), expected[:1])


async def test_postprocess_gives_each_samples_answer():
    engine = linear_engine(postprocess=lambda out: [{"label": int(i)} for i in out.argmax(1)])
    inputs = [[1.0, -2.0, 0.5], [-3.0, 1.0, 2.0]]
    async with running(engine) as (client, _):
        await ready(client)
        answer = await client.post("/v1/predict", json={"inputs": inputs})
    assert answer.json() == {"outputs": [{"label": int(i)} for i in reference(engine, inputs).argmax(1)]}


async def test_preprocess_reads_the_request_as_declared_and_feeds_the_model_its_own_input():
    pixels = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4) * 10
    servable = Servable(
        model=torch.nn.Flatten(), input_shape=(3, 4), input_dtype="uint8", preprocess=lambda x: x.float() / 255
    )
    engine = InferenceEngine(servable, device="cpu", precision="fp32", compile="off", max_batch_size=4)
    async with running(engine) as (client, _):
        await ready(client)
        answer = await client.post("/v1/predict", json={"inputs": pixels.tolist()})
        fraction = await client.post("/v1/predict", json={"inputs": (pixels / 255).tolist()})
    assert answer.status_code == 200
    torch.testing.assert_close(torch.tensor(answer.json()["outputs"]), torch.tensor(pixels).flatten(1).float() / 255)
    assert fraction.status_code == 422 and "uint8" in fraction.json()["error"]  # checked as the request's dtype


@pytest.mark.parametrize(
    ("body", "status", "problem"),
    [
        (b'{"inputs": [1, 2,', 400, "not valid JSON"),
        (b"", 400, 'the body is empty: send JSON {"inputs": [...]}'),
        (b" \n", 400, 'the body is empty: send JSON {"inputs": [...]}'),
        (b"[[1, 2, 3]]", 422, 'a JSON object {"inputs": [...]}'),
        (b'{"input": [1, 2, 3]}', 422, 'the JSON object has no "inputs" key (its keys: "input"); send {"inputs"'),
        (
            b'{"inputs": ' + b"[" * 70 + b"1" + b"]" * 70 + b"}",
            422,
            "inputs are lists nested 70 deep; a batch of samples of shape (3,) is nested 2 deep",
        ),
        (b'{"inputs": [1, 2]}', 422, "inputs have shape (2,)"),
        (b'{"inputs": [[1, 2, 3], [1, 2]]}', 422, "unequal lengths: inputs[1] has 2 items where inputs[0] has 3"),
        (b'{"inputs": [[1, 2, 3], 4]}', 422, "unequal lengths: inputs[1] is a number where inputs[0] has 3 items"),
        (b'{"inputs": [[[1], [2, 3]]]}', 422, "inputs[0][1] has 2 items where inputs[0][0] has 1 item;"),
        # samples each even within, unlike each other: before, where they differ went unsaid
        (b'{"inputs": [[[1, 2], [3, 4]], [[1], [2]]]}', 422, "inputs[1][0] has 1 item where inputs[0][0] has 2 items;"),
        (b'{"inputs": [[[1, 2]], [[1, 2], [3, 4]]]}', 422, "inputs[1] has 2 items where inputs[0] has 1 item;"),
        (b'{"inputs": ["a", "b", "c"]}', 422, "not numbers"),
        (b'{"inputs": [1, null, 3]}', 422, "not numbers"),
        (b'{"inputs": []}', 422, "inputs hold no sample"),
        (b'{"inputs": [NaN, 1, 2]}', 422, "NaN at line 1 column 13, which JSON has no number for"),
        (b'{"inputs": [1, Infinity, 2]}', 422, "Infinity at line 1 column 16, which JSON has no number for"),
        (b'{"inputs": [1, 2, -Infinity]}', 422, "-Infinity at line 1 column 19, which JSON has no number for"),
        (b'{"inputs": [1e400, 1, 2]}', 422, "1e400 at line 1 column 13, beyond float64's range"),
        (b'{"inputs": [true, 0, 0]}', 422, "true/false where numbers are expected"),
        (b'{"inputs": [[1, 2, 3]]}', 200, None),
    ],
)
async def test_malformed_or_misshapen_json_is_refused_naming_the_problem_and_the_expected_shape(body, status, problem):
    async with running(FakeEngine()) as (client, _):
        answer = await client.post("/v1/predict", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    if problem:
        error = answer.json()
        assert problem in error["error"] and "one sample of shape (3,)" in error["error"]
        assert (error["expected_shape"], error["expected_dtype"]) == ([3], "float32")


@pytest.mark.parametrize(
    ("content_type", "fix"),
    [
        ("application/x-www-form-urlencoded", "curl -d sends application/x-www-form-urlencoded unless told: "
                                              "add -H 'Content-Type: application/json'"),
        ("multipart/form-data; boundary=x", "send the array as the whole body, not a form's file: "
                                            "curl --data-binary @x.npy -H 'Content-Type: application/octet-stream'"),
    ],
)  # fmt: skip
async def test_the_content_types_of_curls_forms_get_415_with_the_flags_that_fix_them(content_type, fix):
    async with running(FakeEngine()) as (client, _):
        body = b'{"inputs": [1, 2, 3]}'
        answer = await client.post("/v1/predict", content=body, headers={"content-type": content_type})
    assert answer.status_code == 415 and answer.json()["reason"] == "unsupported_media_type"
    assert answer.json()["error"].endswith(fix), answer.json()["error"]


async def test_a_npy_body_curl_sent_as_a_form_is_told_the_octet_stream_type_not_json():
    # the hint said to add Content-Type: application/json, which a .npy body then failed as JSON
    async with running(FakeEngine()) as (client, _):
        answer = await client.post("/v1/predict", content=npy(np.zeros((2, 3), np.float32)),
                                   headers={"content-type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert answer.status_code == 415 and "the body is a .npy array" in answer.json()["error"]
    assert answer.json()["error"].endswith("add -H 'Content-Type: application/octet-stream'")


async def test_a_bad_value_in_a_batch_is_refused_naming_the_first_sample_that_holds_one():
    octet = {"content-type": "application/octet-stream"}
    batch = np.zeros((4, 3), np.float32)
    batch[2, 1], batch[3, 0] = np.nan, np.inf
    async with running(FakeEngine()) as (client, _):
        floats = await client.post("/v1/predict", content=npy(batch), headers=octet)
    async with running(FakeEngine(input_dtype="uint8")) as (client, _):
        integers = await client.post("/v1/predict", json={"inputs": [[0, 1, 2], [3, 4, 5], [6, 7, 256]]})
        one = await client.post("/v1/predict", json={"inputs": [6, 7, -1]})
    assert floats.status_code == integers.status_code == one.status_code == 422
    said = floats.json()["error"]
    assert "not finite in float32 (NaN, infinity or beyond ±3.40282e+38), the first in sample 2;" in said
    assert floats.json()["first_bad_sample"] == 2
    assert "integers outside uint8's range [0, 255], the first in sample 2;" in integers.json()["error"]
    assert integers.json()["first_bad_sample"] == 2
    assert "the first in sample" not in one.json()["error"], "a lone sample is not numbered"
    assert one.json()["first_bad_sample"] == 0


async def test_an_empty_body_is_said_to_be_empty_whatever_its_type():
    async with running(FakeEngine()) as (client, _):
        bare = await client.post("/v1/predict")  # curl -X POST URL, without -d: no body, no Content-Type
        npy_typed = await client.post("/v1/predict", headers={"content-type": "application/octet-stream"})
    assert bare.status_code == npy_typed.status_code == 400
    assert bare.json()["error"].startswith('the body is empty: send JSON {"inputs": [...]} or a .npy array')
    assert npy_typed.json()["error"].startswith("the body is empty")


async def test_too_many_samples_wrong_dtypes_and_bad_npy_are_refused_before_the_model():
    engine = FakeEngine(input_dtype="int64", max_batch_size=4)
    post = "/v1/predict"
    octet = {"content-type": "application/octet-stream"}
    async with running(engine, max_batch_size=4) as (client, _):
        too_many = await client.post(post, json={"inputs": [[1, 2, 3]] * 5})
        floats = await client.post(post, json={"inputs": [1.5, 2, 3]})
        whole = await client.post(post, json={"inputs": [[1.0, 2, 3]]})
        beyond = await client.post(post, content=npy(np.array([2**63, 1, 1], np.uint64)), headers=octet)
        huge = await client.post(post, json={"inputs": [2**64, 1, 1]})  # beyond 64 bits: orjson reads a float
        nan = await client.post(post, content=npy(np.array([np.nan, 1, 2])), headers=octet)
        garbage = await client.post(post, content=b"not a numpy file", headers=octet)
        lying = await client.post(post, content=npy(np.zeros((4, 3), np.int64))[:-8], headers=octet)
        negative = npy(np.zeros((1, 3), np.int64)).replace(b"(1, 3), }", b"(-1,-3),}")  # 3 elements, as the data
        negative = await client.post(post, content=negative, headers=octet)
        text = await client.post(post, content=b"1,2,3", headers={"content-type": "text/plain"})
        good = await client.post(post, content=npy(np.array([[1, 2, 3]], np.int32)), headers=octet)
    assert too_many.status_code == 422 and "5 samples, more than max_batch_size=4" in too_many.json()["error"]
    assert floats.status_code == 422 and floats.json()["error"].startswith(
        "inputs hold values that are not whole numbers (a fraction, NaN or infinity), where int64 takes integers;"
    )
    assert beyond.status_code == 422 and "outside int64's range" in beyond.json()["error"]
    assert huge.status_code == 422 and "integers outside int64's range" in huge.json()["error"], huge.json()
    assert nan.status_code == 422 and "not whole numbers (a fraction, NaN or infinity)" in nan.json()["error"]
    assert garbage.status_code == 400 and "not a .npy array" in garbage.json()["error"]
    assert lying.status_code == 400 and "bytes of data follow" in lying.json()["error"]
    assert negative.status_code == 400 and "(-1, -3), with a negative dimension" in negative.json()["error"]
    assert text.status_code == 415 and "application/json" in text.json()["error"]
    assert good.status_code == 200 and good.json() == {"outputs": [[2.0, 4.0, 6.0]]}
    assert whole.json() == {"outputs": [[2.0, 4.0, 6.0]]}
    assert engine.batches == [1, 1], "only the valid requests reached the model"


async def test_a_fraction_among_whole_numbers_for_an_integer_model_names_its_sample():
    async with running(FakeEngine(input_dtype="int64", max_batch_size=4)) as (client, _):
        answer = await client.post("/v1/predict", json={"inputs": [[1, 2, 3], [4.0, 5.5, 6], [7, 8, 9.0]]})
    assert answer.status_code == 422 and answer.json()["first_bad_sample"] == 1, answer.json()
    assert answer.json()["error"].startswith(
        "inputs hold values that are not whole numbers (a fraction, NaN or infinity), where int64 takes integers, "
        "the first in sample 1; expected int64 integers"
    )


async def test_a_npy_header_that_is_cut_off_or_malformed_is_a_400_not_a_500():
    header = b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,"  # the closing brackets never come
    cut = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 12
    async with running(FakeEngine()) as (client, _):
        answer = await client.post("/v1/predict", content=cut, headers={"content-type": "application/octet-stream"})
    assert answer.status_code == 400 and answer.json()["reason"] == "bad_request"
    assert "not a .npy array" in answer.json()["error"]


async def test_tensors_a_postprocess_returns_are_answered_as_their_values_as_numpy_arrays_are():
    # scores.argmax(1) is a tensor: answered as numbers, as scores.argmax(1).numpy() always was
    postprocesses = {
        "tensor": lambda out: out.argmax(1),
        "numpy": lambda out: out.argmax(1).numpy(),
        "0-d tensors in dicts": lambda out: [
            {"label": i, "scores": row} for i, row in zip(out.argmax(1), out, strict=True)
        ],
        # before, a view orjson does not write (a row of a Fortran-ordered array) or a float16 array was a 500
        "numpy views in dicts": lambda out: [
            {"label": np.int64(i), "scores": row, "half": row.astype(np.float16)}
            for i, row in zip(out.argmax(1).numpy(), np.asfortranarray(out.numpy()), strict=True)
        ],
    }
    inputs = [[1.0, -2.0, 0.5], [-3.0, 1.0, 2.0]]
    answers = {}
    for name, postprocess in postprocesses.items():
        engine = linear_engine(postprocess=postprocess)
        async with running(engine) as (client, _):
            await ready(client)
            answers[name] = await client.post("/v1/predict", json={"inputs": inputs})
    expected = reference(engine, inputs)
    labels = [int(i) for i in expected.argmax(1)]
    assert [answer.status_code for answer in answers.values()] == [200] * 4, answers["numpy views in dicts"].text
    assert answers["tensor"].json() == answers["numpy"].json() == {"outputs": labels}
    for name in ("0-d tensors in dicts", "numpy views in dicts"):
        given = answers[name].json()["outputs"]
        assert [item["label"] for item in given] == labels
        torch.testing.assert_close(torch.tensor([item["scores"] for item in given]), expected)
    halves = torch.tensor([item["half"] for item in answers["numpy views in dicts"].json()["outputs"]])
    torch.testing.assert_close(halves, expected, atol=1e-2, rtol=1e-3)


async def test_outputs_a_postprocess_made_unserialisable_fail_with_a_json_500_counted_as_such(caplog):
    engine = FakeEngine()
    engine.servable = Servable(model=torch.nn.Identity(), input_shape=(3,), postprocess=lambda out: [{1}] * len(out))
    async with running(engine) as (client, _):
        with caplog.at_level(logging.WARNING, logger="redline"):
            answer = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        page = metrics((await client.get("/metrics")).text)
    assert "a request's outputs are not JSON" in caplog.text  # the server's log said nothing, as no other 500 does
    assert answer.status_code == 500 and answer.json()["reason"] == "model_error"
    assert "not JSON" in answer.json()["error"] and "set" in answer.json()["error"]
    assert page['redline_serve_requests_total{"status": "500"}'] == 1
    assert 'redline_serve_requests_total{"status": "200"}' not in page


@pytest.mark.parametrize(
    ("postprocess", "problem"),
    [
        (lambda out: {"labels": out.argmax(1).tolist()}, "postprocess returned dict; expected a list"),
        (lambda out: None, "postprocess returned NoneType; expected a list"),
        (lambda out: [1, 2], "postprocess returned 2 values for 1 samples"),
        (lambda out: set(out.argmax(1).tolist()), "postprocess returned set; expected a list"),  # in no sample order
    ],
)
async def test_a_postprocess_that_does_not_give_one_value_per_sample_is_a_500_naming_what_it_gave(postprocess, problem):
    async with running(linear_engine(postprocess=postprocess)) as (client, _):
        await ready(client)
        answer = await client.post("/v1/predict", json={"inputs": [[1, 2, 3]]})
    assert answer.status_code == 500 and answer.json()["reason"] == "model_error", answer.text
    assert problem in answer.json()["error"]


async def test_a_compressed_body_is_refused_naming_its_encoding_not_read_as_broken_json():
    body = gzip.compress(b'{"inputs": [1, 2, 3]}')
    async with running(FakeEngine()) as (client, _):
        headers = {"content-type": "application/json", "content-encoding": "gzip"}
        zipped = await client.post("/v1/predict", content=body, headers=headers)
        plain = await client.post("/v1/predict", json={"inputs": [1, 2, 3]}, headers={"content-encoding": "identity"})
    assert zipped.status_code == 415 and zipped.json()["reason"] == "unsupported_media_type"
    assert zipped.json()["error"].startswith("Content-Encoding 'gzip' is not read; send the body uncompressed")
    assert plain.status_code == 200


async def test_non_finite_floats_are_refused():
    async with running(FakeEngine(input_dtype="float16")) as (client, _):
        answer = await client.post("/v1/predict", json={"inputs": [1e6, 0, 0]})  # beyond float16's 65504
    assert answer.status_code == 422 and "not finite in float16" in answer.json()["error"]


async def test_a_body_over_the_limit_is_refused_by_its_length_and_by_the_bytes_streamed():
    async with running(FakeEngine(), max_body_mb=0.001) as (client, _):  # 1048 bytes
        declared = await client.post("/v1/predict", content=b"x" * 2000, headers={"content-type": "application/json"})

        async def chunks():
            for _ in range(4):
                yield b" " * 600

        streamed = await client.post("/v1/predict", content=chunks(), headers={"content-type": "application/json"})
        page = metrics((await client.get("/metrics")).text)
    assert "content-length" not in streamed.request.headers
    assert declared.status_code == streamed.status_code == 413
    assert "max_body_mb=0.001" in streamed.json()["error"]
    assert page['redline_serve_rejections_total{"reason": "body_too_large"}'] == 2


async def test_a_full_batch_over_the_body_limit_is_told_at_start_and_its_413_says_how_many_samples_fit(caplog):
    engine = FakeEngine(input_shape=(256,), max_batch_size=8)  # 1 KiB a float32 sample, 8.125 KiB a full .npy body
    caplog.set_level("WARNING", logger="redline")
    async with running(engine, max_body_mb=0.005) as (client, _):  # 5242 bytes: 4 samples and the header
        said = [r.getMessage() for r in caplog.records if "--max-body-mb" in r.getMessage()]
        octet = {"content-type": "application/octet-stream"}
        four = await client.post("/v1/predict", content=npy(np.ones((4, 256), np.float32)), headers=octet)
        five = await client.post("/v1/predict", content=npy(np.ones((5, 256), np.float32)), headers=octet)
    assert len(said) == 1, caplog.text
    assert said[0].startswith(
        "a request of --max-batch-size 8 samples of shape (256,) is 0.00793 MiB as a float32 .npy body (as JSON, as "
        "its numbers are written), over --max-body-mb 0.005: it is refused with 413; a .npy request holds at most 4 "
        "samples"
    )
    assert "hint: --max-body-mb 0.00794 lets a request of 8 samples in, or --max-batch-size 4" in said[0]
    assert four.status_code == 200 and five.status_code == 413
    assert "(a float32 .npy body of up to 4 samples fits; as JSON, as its numbers are written)" in five.json()["error"]


def test_a_body_limit_that_not_even_one_sample_fits_says_only_short_json_can_pass(caplog):
    # it said "no request can pass", where JSON of small numbers (shorter than .npy's four bytes each) did
    caplog.set_level("WARNING", logger="redline")
    build_app(FakeEngine(input_shape=(3, 512, 512), max_batch_size=4), ServeOptions(max_batch_size=4, max_body_mb=1))
    said = "and so is a .npy request of one sample (3 MiB): only JSON whose numbers are written short can pass\n"
    assert said + "hint: --max-body-mb 12.1" in caplog.text


def test_a_full_batch_within_the_body_limit_is_not_warned_of(caplog):
    caplog.set_level("WARNING", logger="redline")
    build_app(FakeEngine(input_shape=(3, 224, 224), max_batch_size=8), ServeOptions(max_batch_size=8))  # 4.6 MiB
    assert "--max-body-mb" not in caplog.text


async def test_a_token_is_required_and_compared_when_token_env_is_set(monkeypatch):
    monkeypatch.setenv("REDLINE_TEST_TOKEN", "s3cret\n")  # as read from a secret file, newline and all
    async with running(FakeEngine(), token_env="REDLINE_TEST_TOKEN") as (client, _):
        missing = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        wrong = await client.post("/v1/predict", json={"inputs": [1, 2, 3]}, headers={"authorization": "Bearer nope"})
        right = await client.post("/v1/predict", json={"inputs": [1, 2, 3]}, headers={"authorization": "Bearer s3cret"})
        hidden_metrics = await client.get("/metrics")
        probe = await client.get("/livez")
    assert missing.status_code == wrong.status_code == hidden_metrics.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert right.status_code == 200 and probe.status_code == 200
    monkeypatch.setenv("REDLINE_TEST_TOKEN", "")
    with pytest.raises(ConfigError, match="--token-env REDLINE_TEST_TOKEN: the variable is empty"):
        build_app(FakeEngine(), ServeOptions(token_env="REDLINE_TEST_TOKEN", max_batch_size=8))


async def test_a_token_beyond_ascii_lets_in_the_client_that_sends_it(monkeypatch):
    monkeypatch.setenv("REDLINE_TEST_TOKEN", "clé-sûre")
    async with running(FakeEngine(), token_env="REDLINE_TEST_TOKEN") as (client, _):
        right = await client.post("/v1/predict", json={"inputs": [1, 2, 3]},
                                  headers={"authorization": "Bearer clé-sûre".encode()})  # fmt: skip
        wrong = await client.post("/v1/predict", json={"inputs": [1, 2, 3]},
                                  headers={"authorization": b"Bearer cle-sure"})  # fmt: skip
    assert right.status_code == 200, right.text
    assert wrong.status_code == 401


def test_options_refuse_bad_values_and_a_batch_cap_above_the_engines():
    with pytest.raises(ConfigError, match="port=70000"):
        ServeOptions(port=70000)
    for wait in (-1, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"max_wait_ms=.* is not allowed; expected finite milliseconds >= 0"):
            ServeOptions(max_wait_ms=wait)
    with pytest.raises(ConfigError, match="queue_size=0"):
        ServeOptions(queue_size=0)
    with pytest.raises(ConfigError, match="token_env='MY-TOKEN'"):
        ServeOptions(token_env="MY-TOKEN")
    with pytest.raises(ConfigError, match="max_batch_size=16 is not allowed; expected at most the engine's"):
        build_app(FakeEngine(max_batch_size=8), ServeOptions(max_batch_size=16))


@pytest.mark.parametrize("shape", [3, "3", None, (3, 0)])
def test_a_servable_with_an_input_shape_that_is_not_a_shape_is_refused_naming_the_field(shape):
    with pytest.raises(ConfigError, match=r"input_shape=.* is not allowed; expected positive integers"):
        Servable(model=torch.nn.Linear(3, 2), input_shape=shape)


async def test_a_body_sent_under_the_other_content_type_is_told_the_type_to_send():
    array = np.array([[1, 2, 3]], np.float32)
    async with running(FakeEngine()) as (client, _):
        npy_as_json = await client.post("/v1/predict", content=npy(array), headers={"content-type": "application/json"})
        json_as_npy = await client.post(
            "/v1/predict", content=b' {"inputs": [1, 2, 3]}', headers={"content-type": "application/octet-stream"}
        )
        untyped = await client.post("/v1/predict", content=npy(array))  # as requests.post(url, data=...) sends it
    assert npy_as_json.status_code == 400 and npy_as_json.json()["error"].startswith(
        "the body is a .npy array, sent as JSON (Content-Type application/json); send it with "
        "Content-Type: application/octet-stream;"
    ), npy_as_json.json()
    assert json_as_npy.status_code == 400 and json_as_npy.json()["error"].startswith(
        "the body is JSON, sent as a .npy array (Content-Type application/octet-stream); send it with "
        "Content-Type: application/json;"
    ), json_as_npy.json()
    assert "content-type" not in untyped.request.headers
    assert untyped.status_code == 200 and untyped.json() == {"outputs": [[2.0, 4.0, 6.0]]}, untyped.text


def test_a_batch_wait_as_long_as_the_request_timeout_is_refused_as_it_would_never_wait():
    # The batcher runs a batch before its first request's deadline: a wait that long would be no wait at all.
    with pytest.raises(ConfigError, match=r"max_wait_ms=50 is not allowed; expected less than timeout_ms=20\n"):
        ServeOptions(max_wait_ms=50, timeout_ms=20)
    with pytest.raises(ConfigError, match="max_wait_ms=20 is not allowed"):
        ServeOptions(max_wait_ms=20, timeout_ms=20)
    assert ServeOptions(max_wait_ms=19, timeout_ms=20).max_wait_ms == 19
    result = CliRunner().invoke(app, ["serve", "example:digits", "--max-wait-ms", "50", "--timeout-ms", "20"])
    assert isinstance(result.exception, ConfigError), result.output
    assert str(result.exception) == (
        "--max-wait-ms=50.0 is not allowed; expected less than --timeout-ms 20\nhint: a batch runs before its first "
        "request's deadline, so it would never wait for more requests: e.g. --max-wait-ms 5"
    )


async def test_the_document_states_the_servers_limits_and_every_content_type_it_reads():
    async with running(FakeEngine(), max_body_mb=2, timeout_ms=1500) as (client, _):
        document = (await client.get("/openapi.json")).json()
        predict = document["paths"]["/v1/predict"]["post"]
        octet = predict["requestBody"]["content"]["application/octet-stream"]["schema"]["description"]
        x_npy = await client.post(
            "/v1/predict", content=npy(np.ones((2, 3), np.float32)), headers={"content-type": "application/x-npy"}
        )
    assert "read alike as application/x-npy, or without a Content-Type" in octet and x_npy.status_code == 200
    assert predict["requestBody"]["description"] == "At most 2 MiB (--max-body-mb)."
    said = {status: answer["description"] for status, answer in predict["responses"].items()}
    assert "limit, 2 MiB (--max-body-mb)" in said["413"]
    assert "timeout, 1500 ms (--timeout-ms)" in said["504"] and "timeout, 1500 ms (--timeout-ms)" in said["408"]


async def test_a_model_of_scalar_samples_is_told_its_batch_shape_as_python_writes_it():
    async with running(FakeEngine(input_shape=())) as (client, _):
        one = await client.post("/v1/predict", json={"inputs": 2.0})
        several = await client.post("/v1/predict", json={"inputs": [1.0, 2.0]})
        nested = await client.post("/v1/predict", json={"inputs": [[1.0]]})
    assert one.json() == {"outputs": [4.0]} and several.json() == {"outputs": [2.0, 4.0]}
    assert nested.status_code == 422
    assert nested.json()["error"] == (
        "inputs have shape (1, 1); expected float32 numbers, one sample of shape () or up to 8 of them, shape (N,)"
    )


async def test_a_batch_over_the_limit_is_refused_by_its_count_before_its_numbers_are_read():
    """Before, numpy read every number of a 100,000-sample body first, for seconds, and then refused it."""
    samples = [[1.0, 2.0, 3.0]] * 20
    samples[15] = [1.0, 2.0]  # ragged too: refused for its count, so never read that far
    async with running(FakeEngine(max_batch_size=8)) as (client, _):
        answer = await client.post("/v1/predict", json={"inputs": samples})
        one = await client.post("/v1/predict", json={"inputs": [1.0] * 20})  # one sample of 20 numbers
    assert answer.status_code == 422, answer.text
    assert "inputs hold 20 samples, more than max_batch_size=8 in one request" in answer.json()["error"]
    assert one.status_code == 422 and "inputs have shape (20,)" in one.json()["error"]


async def test_a_large_body_is_read_off_the_event_loop_and_a_small_one_on_it(monkeypatch):
    """Before, seconds of numpy work on a large JSON batch held the loop: /livez went unanswered meanwhile."""
    readers, read_json = [], serve_app.read_json

    def recording(body, spec):
        readers.append(threading.get_ident())
        return read_json(body, spec)

    monkeypatch.setattr(serve_app, "read_json", recording)
    loop_thread = threading.get_ident()
    engine = linear_engine()
    inputs = [[1.0, -2.0, 0.5]] * 4
    async with running(engine) as (client, _):
        await ready(client)
        small = await client.post("/v1/predict", json={"inputs": inputs})
        monkeypatch.setattr(serve_app, "PARSED_ASIDE", 16)  # this body counts as large now
        large = await client.post("/v1/predict", json={"inputs": inputs})
    assert small.status_code == large.status_code == 200 and small.json() == large.json()
    assert readers[0] == loop_thread and readers[1] != loop_thread
