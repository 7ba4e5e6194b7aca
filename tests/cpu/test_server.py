"""The HTTP server at work: batching, a full queue, deadlines, readiness, a failing model, and a real process stopped
by SIGTERM. What it reads and refuses at the door is in test_server_inputs.py."""

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
import uvicorn
from serve_client import eventually, fill_the_queue, metrics, ready, reference, running
from serve_engines import POISON, FakeEngine, Slow, linear_engine
from torch import nn
from typer.testing import CliRunner

from redline.cli import serve as serve_cli
from redline.cli.main import app
from redline.errors import ConfigError, RedlineError, ServableError, describe_error
from redline.serve import dispatch as dispatch_module
from redline.serve import engine as engine_module
from redline.serve import server as server_module
from redline.serve.app import build_app
from redline.serve.batcher import bucket_sizes
from redline.serve.engine import InferenceEngine
from redline.serve.options import ServeOptions
from redline.serve.servable import Servable
from redline.serve.server import stopped_by

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_concurrent_requests_run_together_in_one_thread_of_the_models_own():
    engine = FakeEngine()
    async with running(engine, max_wait_ms=200) as (client, _):
        answers = await asyncio.gather(*[client.post("/v1/predict", json={"inputs": [i, i, i]}) for i in range(8)])
        page = metrics((await client.get("/metrics")).text)
    assert [a.json()["outputs"] for a in answers] == [[[2.0 * i] * 3] for i in range(8)]
    assert page["redline_serve_batch_samples_sum{}"] == 8
    assert page["redline_serve_batch_samples_count{}"] < 8, "no two requests shared a batch"
    assert max(engine.batches) > 1
    assert len(engine.threads) == 1 and threading.main_thread().name not in engine.threads
    assert page['redline_serve_requests_total{"status": "200"}'] == 8
    assert page["redline_serve_latency_seconds_count{}"] == page["redline_serve_queue_seconds_count{}"] == 8


@pytest.mark.parametrize(("timeout_ms", "slowest_s"), [(10_000, 10.5), (90_000, 95.0), (4_000_000, 4_200.0)])
def test_the_time_histograms_have_a_bucket_for_every_answer_up_to_the_deadline(timeout_ms, slowest_s):
    serving = build_app(FakeEngine(), ServeOptions(max_batch_size=8, timeout_ms=timeout_ms)).state.serving
    for histogram in (serving.metrics.latency_seconds, serving.metrics.queue_seconds):
        histogram.observe(slowest_s)  # a 504 goes out a little after the deadline
    page = metrics(serving.metrics.render().decode())
    for name in ("redline_serve_latency_seconds", "redline_serve_queue_seconds"):
        finite = sorted(float(key.split('"le": "')[1].split('"')[0]) for key in page
                        if key.startswith(name + "_bucket") and '"+Inf"' not in key)  # fmt: skip
        # Counted in +Inf alone, histogram_quantile would give the last finite bound as its p99: 30 s for minutes
        assert finite[-1] >= slowest_s and page[f'{name}_bucket{{"le": "{finite[-1]}"}}'] == 1
    assert finite[:15] == [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


async def test_refusals_that_never_reached_the_queue_stay_out_of_the_latency_histogram():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its first batch
    async with running(engine, queue_size=1, max_batch_size=1) as (client, serving):
        sent = await fill_the_queue(client, engine, serving, waiting=1)
        refused = [await client.post("/v1/predict", json={"inputs": [3, 3, 3]}) for _ in range(3)]
        engine.gate.set()
        for task in sent:
            await task
        page = metrics((await client.get("/metrics")).text)
    assert [answer.status_code for answer in refused] == [503] * 3
    assert page['redline_serve_rejections_total{"reason": "queue_full"}'] == 3
    assert page["redline_serve_latency_seconds_count{}"] == 2, "only the two queued requests were timed"


async def test_a_full_queue_answers_503_with_retry_after_and_the_accepted_requests_finish():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its first batch
    async with running(engine, queue_size=2, max_batch_size=1) as (client, serving):
        sent = await fill_the_queue(client, engine, serving, waiting=2)
        refused = await client.post("/v1/predict", json={"inputs": [4, 4, 4]})
        engine.gate.set()
        accepted = [await task for task in sent]
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["reason"] == "queue_full" and "queue is full (2 requests waiting)" in refused.json()["error"]
    assert [a.json()["outputs"] for a in accepted] == [[[2.0 * i] * 3] for i in (1, 2, 3)]


async def test_stopping_at_once_answers_the_running_and_queued_requests_503_and_waits_for_no_batch():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its batch, as a slow one would, past the shutdown
    try:
        async with running(engine, max_batch_size=1) as (client, serving):
            sent = await fill_the_queue(client, engine, serving, waiting=2)
            assert serving.abandon() == 3, "one in the model, two queued"
            answers = [await asyncio.wait_for(task, 5) for task in sent]
            # one more on a connection still open: refused too, not queued behind a worker that is stopping
            answers.append(await asyncio.wait_for(client.post("/v1/predict", json={"inputs": [5, 5, 5]}), 5))
            closing = time.monotonic()
        closed_in = time.monotonic() - closing  # the app's shutdown: the worker, stopped without the batch's end
        page = metrics(serving.metrics.render().decode())
    finally:
        engine.gate.set()
    assert [a.status_code for a in answers] == [503, 503, 503, 503]
    assert {a.json()["reason"] for a in answers} == {"shutting_down"}
    assert "stopped at once (a second Ctrl-C) before this request was answered" in answers[0].json()["error"]
    assert closed_in < 5, f"the shutdown waited {closed_in:.1f} s for the batch held in the model"
    assert page['redline_serve_requests_total{"status": "503"}'] == 4


async def test_a_stop_waits_for_every_answer_but_not_for_a_model_call_whose_requests_all_timed_out(caplog):
    engine = FakeEngine()
    engine.gate.clear()  # a hung model: it holds its batch for 10 s, past every deadline and the shutdown
    try:
        async with running(engine, max_batch_size=1, timeout_ms=200) as (client, serving):
            first = asyncio.create_task(client.post("/v1/predict", json={"inputs": [1, 1, 1]}))
            await eventually(lambda: engine.threads)
            queued = asyncio.create_task(client.post("/v1/predict", json={"inputs": [2, 2, 2]}))
            await eventually(lambda: serving.dispatcher.queued == 1)
            serving.begin_drain()  # as SIGTERM does: the stop begins with both requests unanswered
            closing = time.monotonic()
            model_thread = serving.dispatcher._thread
        closed_in = time.monotonic() - closing
        answers = [await first, await queued]
        left_in_its_call = model_thread.alive and dispatch_module.calls_left_running() >= 1
    finally:
        engine.gate.set()
    assert [a.status_code for a in answers] == [504, 504], "each request was answered, at its deadline"
    assert 0.1 < closed_in < 3, f"the shutdown took {closed_in:.1f} s: it waits for the answers, not the model"
    assert "it is not waited for" in caplog.text
    assert left_in_its_call, "a process exiting now must know that a model call still runs"
    await eventually(lambda: not model_thread.alive)  # the call returned: the stopped thread ends


async def test_a_stop_with_nothing_in_the_model_waits_for_the_model_thread_to_end():
    # A daemon thread alive at interpreter shutdown aborts the process when it next retakes the GIL from torch.
    engine = FakeEngine()
    async with running(engine) as (client, serving):
        assert (await client.post("/v1/predict", json={"inputs": [1, 1, 1]})).status_code == 200
        model_thread = serving.dispatcher._thread
        assert model_thread.alive
    assert not model_thread.alive, "the closed dispatcher returned before its model thread ended"


async def test_requests_that_timed_out_in_the_queue_do_not_count_toward_a_full_queue():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its first batch past every deadline
    async with running(engine, queue_size=2, max_batch_size=1, timeout_ms=300) as (client, _):
        first = asyncio.create_task(client.post("/v1/predict", json={"inputs": [1, 1, 1]}))
        await eventually(lambda: engine.threads)
        expired = await asyncio.gather(*[client.post("/v1/predict", json={"inputs": [i, i, i]}) for i in (2, 3)])
        later = asyncio.create_task(client.post("/v1/predict", json={"inputs": [4, 4, 4]}))
        await asyncio.sleep(0.02)
        engine.gate.set()
        later, first = await later, await first
    assert [answer.status_code for answer in expired] == [504, 504]
    assert later.status_code == 200 and later.json()["outputs"] == [[8.0, 8.0, 8.0]]


async def test_a_request_past_its_deadline_gets_504_and_the_server_goes_on():
    engine = FakeEngine()
    engine.gate.clear()
    async with running(engine, timeout_ms=200, max_batch_size=1) as (client, _):
        running_one, waiting_one = await asyncio.gather(
            client.post("/v1/predict", json={"inputs": [1, 1, 1]}),
            client.post("/v1/predict", json={"inputs": [2, 2, 2]}),
        )
        engine.gate.set()
        after = await client.post("/v1/predict", json={"inputs": [3, 3, 3]})
        page = metrics((await client.get("/metrics")).text)
    assert running_one.status_code == waiting_one.status_code == 504
    assert "timeout_ms=200" in waiting_one.json()["error"]
    assert after.status_code == 200 and after.json()["outputs"] == [[6.0, 6.0, 6.0]]
    assert engine.batches.count(1) == 2, "the request that expired in the queue never ran"
    assert page['redline_serve_rejections_total{"reason": "timeout"}'] == 2


class Python310Asyncio(types.ModuleType):
    """asyncio as Python 3.10 has it (the package supports it): wait_for raises asyncio.TimeoutError, no builtin."""

    class TimeoutError(Exception):
        pass

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def wait_for(self, awaitable, timeout):
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except TimeoutError:
            raise self.TimeoutError from None


async def test_batching_waits_and_deadlines_work_where_asyncio_has_its_own_timeout_error(monkeypatch):
    monkeypatch.setattr(dispatch_module, "asyncio", Python310Asyncio("asyncio"))
    engine = FakeEngine()
    # A second of deadline: the request after the late one must be answered within it on a loaded machine too.
    async with running(engine, timeout_ms=1000, max_wait_ms=20, max_batch_size=4) as (client, serving):
        waited = await client.post("/v1/predict", json={"inputs": [1, 1, 1]})  # its batch waits max_wait_ms
        engine.gate.clear()
        late = await client.post("/v1/predict", json={"inputs": [2, 2, 2]})  # past its deadline
        engine.gate.set()
        after = await client.post("/v1/predict", json={"inputs": [3, 3, 3]})
        failed = serving.dispatcher.failed
    assert failed is None, failed
    assert waited.status_code == 200 and late.status_code == 504 and after.status_code == 200


async def test_a_model_exception_fails_its_batch_with_500_and_the_next_request_succeeds(caplog, monkeypatch):
    async with running(FakeEngine()) as (client, _):
        failed = await client.post("/v1/predict", json={"inputs": [POISON, 0, 0]})
        logged = [r for r in caplog.records if "the model failed" in r.getMessage()]
        monkeypatch.setenv("REDLINE_TRACEBACK", "1")
        await client.post("/v1/predict", json={"inputs": [POISON, 0, 0]})
        after = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        alive = await client.get("/livez")
    assert failed.status_code == 500 and failed.json()["reason"] == "model_error"
    assert "RuntimeError: the model hit a poisoned sample" in failed.json()["error"]
    assert "serve_engines.py" not in failed.json()["error"], "the client is not told the server's files"
    where = logged[0].getMessage().split("\n")[-1]  # the line of the model's code that raised
    assert "serve_engines.py:" in where and " in predict: raise RuntimeError(" in where
    assert logged[0].exc_info is None, "the traceback only when REDLINE_TRACEBACK=1 asks for it"
    traced = [r for r in caplog.records if "the model failed" in r.getMessage()][-1]
    assert traced.exc_info is not None and isinstance(traced.exc_info[1], RuntimeError)
    assert after.status_code == 200 and after.json() == {"outputs": [[2.0, 4.0, 6.0]]}
    assert alive.status_code == 200


async def test_a_request_the_model_cannot_take_fails_alone_not_with_its_batchmates():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its first batch, while three requests queue behind it
    async with running(engine, max_wait_ms=0) as (client, serving):
        first = asyncio.create_task(client.post("/v1/predict", json={"inputs": [1, 1, 1]}))
        await eventually(lambda: engine.threads)
        queued = [asyncio.create_task(client.post("/v1/predict", json={"inputs": x})) for x in
                  ([2, 2, 2], [POISON, 0, 0], [3, 3, 3])]  # fmt: skip
        await eventually(lambda: serving.dispatcher.queued == 3)
        engine.gate.set()
        answers = [await task for task in [first, *queued]]
        page = metrics((await client.get("/metrics")).text)
    assert [a.status_code for a in answers] == [200, 200, 500, 200]
    assert [answers[i].json()["outputs"] for i in (1, 3)] == [[[4.0] * 3], [[6.0] * 3]]
    assert "poisoned sample" in answers[2].json()["error"]
    assert engine.batches == [1, 3, 1, 1, 1], "the three ran together, then each alone"
    assert page["redline_serve_batch_requests_count{}"] == 2, "the reruns are not counted as batches"


async def test_redlines_own_code_failing_on_a_batch_is_an_internal_error_not_blamed_on_the_model(monkeypatch):
    async with running(linear_engine()) as (client, _):
        await ready(client)
        monkeypatch.setattr(engine_module, "bucket_for", max)  # a builtin: it fails in the engine's own frame
        failed = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        monkeypatch.undo()
        after = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        page = metrics((await client.get("/metrics")).text)
    assert failed.status_code == 500 and failed.json()["reason"] == "internal_error"
    assert "in redline's own code, not the model's: TypeError" in failed.json()["error"]
    assert after.status_code == 200
    assert page['redline_serve_rejections_total{"reason": "internal_error"}'] == 1
    assert page["redline_serve_latency_seconds_count{}"] == 2, "a queued request's failure is timed as any other"


async def test_readyz_waits_for_the_warm_up_and_turns_503_when_draining():
    engine = FakeEngine(ready=False)
    engine.warm_gate.clear()
    async with running(engine) as (client, serving):
        warming = await client.get("/readyz")
        early = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        alive = await client.get("/livez")
        engine.warm_gate.set()
        await ready(client)
        serving.begin_drain()
        draining = await client.get("/readyz")
        still_served = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
    assert warming.status_code == 503 and warming.json() == {"status": "warming_up"}
    assert early.status_code == 503 and early.json()["reason"] == "not_ready" and "retry-after" in early.headers
    assert alive.status_code == 200
    assert draining.status_code == 503 and draining.json() == {"status": "draining"}
    assert still_served.status_code == 200


async def test_a_broken_engine_or_a_failed_warm_up_fails_livez():
    engine = FakeEngine()
    async with running(engine) as (client, _):
        assert (await client.get("/livez")).status_code == 200
        engine.broken = "CUDA error: an illegal memory access was encountered"
        live, readyz = await client.get("/livez"), await client.get("/readyz")
        predict = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
    assert live.status_code == readyz.status_code == predict.status_code == 503
    assert live.json() == {"status": "broken", "reason": engine.broken}
    failing = FakeEngine(ready=False)
    failing.warm_error = RuntimeError("CUDA out of memory")
    async with running(failing) as (client, serving):
        await eventually(lambda: serving.dispatcher.failed is not None)
        live = await client.get("/livez")
    assert live.status_code == 503 and live.json()["reason"] == "warm-up failed: RuntimeError: CUDA out of memory"


async def test_overload_every_request_gets_200_or_503_and_every_200_its_own_outputs():
    torch.manual_seed(0)
    engine = InferenceEngine(Servable(model=Slow(0.05), input_shape=(3,)), device="cpu", precision="fp32",
                             max_batch_size=4)  # fmt: skip
    queue_size = 4
    inputs = np.random.default_rng(1).normal(size=(10 * queue_size, 3)).astype(np.float32)
    async with running(engine, queue_size=queue_size, max_batch_size=4) as (client, _):
        await ready(client)
        answers = await asyncio.gather(*[client.post("/v1/predict", json={"inputs": x.tolist()}) for x in inputs])
        still_ready = await client.get("/readyz")
        page = metrics((await client.get("/metrics")).text)
    statuses = [a.status_code for a in answers]
    assert set(statuses) == {200, 503}, statuses
    expected = reference(engine, inputs)
    for i, answer in enumerate(answers):
        if answer.status_code == 200:
            torch.testing.assert_close(torch.tensor(answer.json()["outputs"]), expected[i : i + 1])
        else:
            assert answer.json()["reason"] == "queue_full" and answer.headers["retry-after"] == "1"
    assert still_ready.status_code == 200
    assert page['redline_serve_requests_total{"status": "200"}'] == statuses.count(200)
    assert page['redline_serve_rejections_total{"reason": "queue_full"}'] == statuses.count(503)
    assert page["redline_serve_queued_requests{}"] == 0


async def test_shutting_down_during_the_warm_up_stops_it_without_failing():
    engine = FakeEngine(ready=False)
    engine.warm_gate.clear()  # a warm-up that would take 10 s
    started = time.monotonic()
    async with running(engine) as (client, serving):
        warming = await client.get("/readyz")
    assert warming.status_code == 503 and time.monotonic() - started < 5
    assert not engine.ready and serving.dispatcher.failed is None


def test_a_port_in_use_and_a_host_not_of_this_machine_each_get_their_own_fix():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(RedlineError, match=r"Address already in use\nhint: pick another --port"):
            server_module.bind("127.0.0.1", busy.getsockname()[1])
    with pytest.raises(RedlineError, match=r"^cannot listen on 192\.0\.2\.1:0: .*\nhint: --host takes an address"):
        server_module.bind("192.0.2.1", 0)  # TEST-NET-1 (RFC 5737): never an address of this machine


def test_a_port_held_while_the_model_loads_is_refused_to_a_second_server_and_kept_by_the_first():
    first = server_module.bind("127.0.0.1", 0)  # not listening yet: as while `redline serve` loads its model
    port = first.getsockname()[1]
    with first:
        with pytest.raises(RedlineError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: Address already in use"):
            server_module.bind("127.0.0.1", port).close()  # a second `redline serve --port` started meanwhile
        server_module.listen(first)  # the first then serves on it
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass


def test_redline_serve_tells_a_busy_port_before_it_loads_the_model(monkeypatch):
    loaded = []
    monkeypatch.setattr(serve_cli, "load_given_servable", lambda *args, **kwargs: loaded.append(args))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = CliRunner().invoke(app, ["serve", "example:digits", "--port", str(busy.getsockname()[1])])
    assert isinstance(result.exception, RedlineError) and "Address already in use" in str(result.exception)
    assert loaded == [], "the model was loaded (and measured, compiled) before the port was tried"
    held = server_module.bind("127.0.0.1", 0)  # the port is held, but refuses connections until serve listens
    with held, pytest.raises(ConnectionRefusedError), socket.create_connection(held.getsockname(), timeout=5):
        pass


def test_redline_serve_naming_no_function_hints_at_what_the_function_may_return(tmp_path):
    (tmp_path / "models.py").write_text("import torch\n")
    result = CliRunner().invoke(app, ["serve", f"{tmp_path / 'models.py'}:nope", "--port", "0"])
    said = str(result.exception)
    # a bare model is refused (its input shape is unknown): the hint does not offer it
    assert said.startswith("model spec") and said.endswith("hint: name a function that returns a Servable (or a Task)")


def test_a_server_started_ignoring_ctrl_c_leaves_it_ignored_and_stops_on_sigterm():
    """A script's background server (`redline serve ... &`) ignores SIGINT: a Ctrl-C to the script spares it."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stops = []
        server = server_module._Server(uvicorn.Config(app=None), lambda: stops.append(True), lambda: 0)
    finally:
        signal.signal(signal.SIGINT, before)
    server.handle_exit(signal.SIGINT, None)
    assert not server.should_exit and stops == []
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and stops == [True]
    server = server_module._Server(uvicorn.Config(app=None), lambda: stops.append(True), lambda: 0)
    server.handle_exit(signal.SIGINT, None)  # where Ctrl-C was not ignored, it stops the server
    assert server.should_exit


def test_serve_freezes_the_heap_once_warmed_up_then_says_ready(monkeypatch):
    said = []

    def run_without_serving(self, sockets=None):  # in place of uvicorn's loop: the worker reports ready
        self.config.app.state.serving.dispatcher.on_ready()

    monkeypatch.setattr(server_module._Server, "run", run_without_serving)
    gc.unfreeze()
    try:
        server_module.serve(
            linear_engine(), ServeOptions(port=0, max_batch_size=8), on_ready=lambda: said.append(gc.get_freeze_count())
        )
    finally:
        gc.unfreeze()
    assert len(said) == 1 and said[0] > 1000  # torch alone leaves many thousands of objects to freeze


async def test_serve_inside_a_running_event_loop_says_how_to_serve_there():
    with pytest.raises(RedlineError, match=r"inside a running event loop .*\nhint: await uvicorn.Server\("):
        server_module.serve(FakeEngine(), ServeOptions(port=0, max_batch_size=8))  # as a Jupyter cell would


SLOW_WARM_UP = """
import time
from torch import nn
from redline.serve.servable import Servable


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        time.sleep(2)  # 12 s to warm the six buckets up to 32
        return self.linear(x)


def make():
    return Servable(model=Slow(), input_shape=(3,))
"""


MISDECLARED = """
from torch import nn
from redline.serve.servable import Servable


class Narrow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x)


def make():
    return Servable(model=Narrow(), input_shape=(3,))
"""


@pytest.mark.slow
def test_redline_serve_whose_model_fails_the_warm_up_exits_1_naming_the_users_line_and_the_fix(tmp_path):
    (tmp_path / "narrow.py").write_text(MISDECLARED)
    command = [sys.executable, "-m", "redline", "serve", f"{tmp_path / 'narrow.py'}:make", "--port", "0",
               "--device", "cpu", "--measure", "off", "--compile", "off"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1, result.stderr
    assert "error: the server stopped: warm-up failed: RuntimeError: mat1 and mat2 shapes" in result.stderr
    assert f"at {tmp_path / 'narrow.py'}:" in result.stderr and "in forward: return self.linear(x)" in result.stderr
    assert "hint: check that the model takes the Servable's input_shape (3,) and input_dtype float32" in result.stderr


@pytest.mark.slow
def test_redline_serve_stopped_by_sigterm_while_warming_up_exits_cleanly_without_finishing_it(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW_WARM_UP)
    command = [sys.executable, "-m", "redline", "serve", f"{tmp_path / 'slow.py'}:make", "--port", "0",
               "--device", "cpu", "--measure", "off", "--compile", "off"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = next((line.split()[2] for line in process.stdout if line.startswith("listening on ")), None)
        assert url, process.stderr.read()
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(url + "/readyz", timeout=5)
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        out, err = process.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, err
    assert took < 8, f"the server took {took:.1f} s to stop: it finished the warm-up first"  # one bucket: 2 s
    assert "ready: warm-up done" not in out


@pytest.mark.slow
def test_redline_serve_answers_and_on_sigterm_finishes_its_queued_request_then_exits_cleanly():
    command = [sys.executable, "-m", "redline", "serve", "example:digits", "--port", "0", "--max-wait-ms", "1500",
               "--measure", "off"]  # fmt: skip
    # Planned as on a CPU with AMX, where bf16 is a candidate: only --measure off keeps it from being timed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "REDLINE_CPU": "amx"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url, plan = None, []
        for line in process.stdout:
            plan.append(line)
            if line.startswith("listening on "):
                url = line.split()[2]
                break
        assert url and url.startswith("http://127.0.0.1:"), process.stderr.read()
        precision = next(line for line in plan if line.startswith("│ precision"))
        assert "│ auto: CPU has AMX" in precision and not any(line.startswith("│ measured") for line in plan)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/readyz", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None, "the server never became ready"
                time.sleep(0.2)
        body = json.dumps({"inputs": np.zeros((1, 8, 8)).tolist()}).encode()
        request = urllib.request.Request(url + "/v1/predict", data=body, headers={"content-type": "application/json"})
        result = {}

        def send():
            with urllib.request.urlopen(request, timeout=30) as answer:
                result["status"], result["body"] = answer.status, json.loads(answer.read())

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(0.5)  # the request waits in the queue for its batch (--max-wait-ms 1500)
        process.send_signal(signal.SIGTERM)
        sender.join(30)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert result["status"] == 200 and len(result["body"]["outputs"][0]) == 10  # ten digit scores
    assert process.returncode == 0, err
    assert "stopped: every accepted request was answered" in out


SLOW_AFTER_WARM_UP = """
import time
import torch
import uvicorn
from torch import nn
from redline.serve.servable import Servable

WARM_UP_CALLS = {warm_up_calls}  # one per bucket
IN_TORCH = {in_torch}  # a slow call runs torch operations for 10 s, each retaking the GIL, instead of sleeping 3 s


class Slow(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > WARM_UP_CALLS and not IN_TORCH:
            time.sleep(3)
        end = time.monotonic() + 10
        while self.calls > WARM_UP_CALLS and IN_TORCH and time.monotonic() < end:
            x = torch.tanh(x)
        return self.linear(x)


def make():
    return Servable(model=Slow(), input_shape=(3,))
"""


def serving_slow_model(tmp_path, *flags, in_torch=False, **popen):
    """``redline serve`` of a model that is slow once warmed up, in a process of its own, ready; and its URL."""
    buckets = len(bucket_sizes(int(flags[flags.index("--max-batch-size") + 1]), "auto"))
    (tmp_path / "slow.py").write_text(SLOW_AFTER_WARM_UP.format(warm_up_calls=buckets, in_torch=in_torch))
    command = [sys.executable, "-m", "redline", "serve", f"{tmp_path / 'slow.py'}:make", "--port", "0",
               "--device", "cpu", "--measure", "off", "--compile", "off", *flags]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **popen)
    url = next((line.split()[2] for line in process.stdout if line.startswith("listening on ")), None)
    if url is None:
        process.kill()
        pytest.fail(f"the server did not listen: {process.stderr.read()}")
    deadline = time.monotonic() + 120
    while True:
        try:
            if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                return process, url
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                pytest.fail("the server never became ready")
            time.sleep(0.2)


def predict_request(url: str) -> urllib.request.Request:
    body = json.dumps({"inputs": [1, 2, 3]}).encode()
    return urllib.request.Request(url + "/v1/predict", data=body, headers={"content-type": "application/json"})


@pytest.mark.slow
def test_a_server_stopped_while_its_model_runs_a_timed_out_batch_exits_0_not_aborted(tmp_path):
    # The model's thread is left in its call: the interpreter's shutdown would end it when torch next returns to
    # Python, and the unwinding through torch's C++ frames would abort the process (-6, perhaps a core dump).
    process, url = serving_slow_model(tmp_path, "--max-batch-size", "1", "--timeout-ms", "300", in_torch=True)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(predict_request(url), timeout=30)
        process.send_signal(signal.SIGTERM)  # the model still runs that batch, for seconds
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert refused.value.code == 504
    assert process.returncode == 0, err
    assert "it is not waited for" in err and "terminate called" not in err
    assert out.rstrip().endswith("stopped: every accepted request was answered")


@pytest.mark.slow
def test_a_second_ctrl_c_answers_the_waiting_requests_503_and_exits_130_saying_so(tmp_path):
    # a process started in the background ignores SIGINT unless told otherwise
    process, url = serving_slow_model(
        tmp_path, "--max-batch-size", "4", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    answers = []

    def send():
        try:
            urllib.request.urlopen(predict_request(url), timeout=30)
        except urllib.error.HTTPError as refused:
            answers.append((refused.code, json.loads(refused.read())))

    try:
        senders = [threading.Thread(target=send) for _ in range(3)]
        for sender in senders:
            sender.start()
        time.sleep(0.5)  # one batch in the model (3 s), the others queued behind it
        process.send_signal(signal.SIGINT)  # a graceful stop: it would answer them all
        time.sleep(0.3)
        process.send_signal(signal.SIGINT)  # stop now
        out, err = process.communicate(timeout=60)
        for sender in senders:
            sender.join(30)
    finally:
        if process.poll() is None:
            process.kill()
    assert [status for status, _ in answers] == [503, 503, 503], (answers, err)
    assert {body["reason"] for _, body in answers} == {"shutting_down"}
    assert process.returncode == 130, err
    assert err.startswith("error: stopped at once by a second Ctrl-C: 3 requests queued or in the model were "
                          "answered 503 without their outputs\nhint: stop the server with one Ctrl-C"), err  # fmt: skip
    assert "Traceback" not in err and "stopped: every accepted request was answered" not in out


def test_a_warm_up_stopped_by_what_the_model_returned_keeps_the_errors_hint():
    # The reason is one line (describe_error); what redline's error says to do is on its hint line.
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    engine = InferenceEngine(Servable(model=Pair(), input_shape=(3,)), device="cpu", precision="fp32", compile="off",
                             max_batch_size=2)  # fmt: skip
    with pytest.raises(ServableError) as raised:
        engine.warm_up()
    said = stopped_by(f"warm-up failed: {describe_error(raised.value)}", raised.value, engine, ServeOptions())
    assert said == (
        "the server stopped: warm-up failed: ServableError: the model returned a tuple of 2 values: tensor (2, 3), "
        "tensor (2, 3); the engine serves models that return one tensor\nhint: serve a module whose forward returns "
        "the one tensor meant: a wrapper whose forward(x) returns self.model(x)[0]"
    )


def test_redline_serve_pads_to_the_batch_buckets_given_and_refuses_bad_ones_before_loading(monkeypatch):
    # On a GPU each bucket is compiled and captured: --max-batch-size 256 alone would warm up nine of them
    served = []
    monkeypatch.setattr(serve_cli, "serve", lambda engine, options, **kwargs: served.append(engine))
    args = ["serve", "example:digits", "--port", "0", "--measure", "off", "--max-batch-size", "8"]
    result = CliRunner().invoke(app, [*args, "--batch-buckets", "1,4,8"])
    assert result.exit_code == 0, result.output
    assert served[0].buckets == (1, 4, 8) and "1, 4, 8" in result.output
    loaded = []
    monkeypatch.setattr(serve_cli, "load_given_servable", lambda *args, **kwargs: loaded.append(args))
    for given, said in [("1,4", "--batch-buckets=(1, 4) is not allowed; expected positive sizes, the largest "
                                "equal to --max-batch-size 8\nhint: add 8 as the largest size, or pass "
                                "--max-batch-size 4 to make it the largest"),
                        ("1,8,16", "--batch-buckets=(1, 8, 16) is not allowed; expected positive sizes, the largest "
                                   "equal to --max-batch-size 8\nhint: drop 16 (above --max-batch-size 8), or pass "
                                   "--max-batch-size 16 to make it the largest"),  # not "add 8 as the largest": it is
                        ("1,4,16,32", "--batch-buckets=(1, 4, 16, 32) is not allowed; expected positive sizes, the "
                                      "largest equal to --max-batch-size 8\nhint: drop 16, 32 (above --max-batch-size "
                                      "8) and add 8 as the largest size, or pass --max-batch-size 32 to make it the "
                                      "largest"),
                        ("0,8", "--batch-buckets=(0, 8) is not allowed; expected positive whole batch sizes\n"
                                "hint: drop 0, keeping 8"),  # not "add 8 as the largest": it is
                        ("1,four,8", "--batch-buckets='1,four,8' is not allowed; expected auto, or batch "
                                     "sizes separated by commas\nhint: e.g. --batch-buckets 1,8,32")]:  # fmt: skip
        refused = CliRunner().invoke(app, [*args, "--batch-buckets", given])
        assert isinstance(refused.exception, ConfigError) and str(refused.exception) == said, refused.exception
    assert loaded == [], "the model was loaded before the flag was checked"


@pytest.mark.parametrize("raised", [SystemExit(4), KeyboardInterrupt()])
async def test_a_model_that_raises_systemexit_or_keyboardinterrupt_fails_its_request_not_the_server(raised):
    # Either one reached the event loop: the request got a plain-text 500 (or no answer) and the server ended.
    engine = FakeEngine()
    predict = engine.predict

    def exits(inputs, *args, **kwargs):
        if bool((inputs == POISON).any()):
            raise raised
        return predict(inputs, *args, **kwargs)

    engine.predict = exits
    async with running(engine) as (client, _):
        await ready(client)
        failed = await client.post("/v1/predict", json={"inputs": [POISON, 0, 0]})
        after = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
        alive = await client.get("/livez")
    assert failed.status_code == 500 and failed.json()["reason"] == "model_error"
    assert failed.json()["error"].startswith(f"the model failed: {type(raised).__name__}")
    assert after.status_code == 200 and after.json() == {"outputs": [[2.0, 4.0, 6.0]]}
    assert alive.status_code == 200
