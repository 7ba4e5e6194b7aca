"""What `redline serve` tells once it listens and once it is ready is for whoever reads its stdout: a reader that went
away (`| grep -m1 listening`), or an ``on_ready`` callback that raises, never stops the server."""

import io
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request

import httpx
import pytest
from serve_client import ready
from serve_engines import FakeEngine

from redline.cli import serve as serve_cli
from redline.serve.app import build_app
from redline.serve.options import ServeOptions

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def test_an_on_ready_callback_that_raises_is_logged_and_the_worker_serves_on(caplog):
    engine = FakeEngine(ready=False)
    app = build_app(engine, ServeOptions(max_batch_size=engine.max_batch_size))
    dispatcher = app.state.serving.dispatcher
    gave_up = []

    def reader_gone():
        raise BrokenPipeError(32, "Broken pipe")

    dispatcher.on_ready, dispatcher.on_failed = reader_gone, gave_up.append
    transport = httpx.ASGITransport(app=app)
    with caplog.at_level(logging.WARNING, logger="redline"):
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://x") as client,
        ):
            await ready(client)
            answer = await client.post("/v1/predict", json={"inputs": [1, 2, 3]})
            live = await client.get("/livez")
    assert answer.status_code == 200 and answer.json()["outputs"] == [[2.0, 4.0, 6.0]]
    assert live.status_code == 200 and dispatcher.failed is None and gave_up == []
    said = "the on_ready callback failed, and the server serves on: BrokenPipeError: [Errno 32] Broken pipe\n  at "
    assert said in caplog.text and "in reader_gone: raise BrokenPipeError" in caplog.text  # the callback's own line


class ReaderGone(io.StringIO):
    """A stdout whose reader exited: every write fails, as a pipe's does."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_line_for_a_reader_gone_is_dropped_and_so_are_the_lines_after_it(monkeypatch, caplog):
    monkeypatch.setattr(sys, "stdout", ReaderGone())
    with caplog.at_level(logging.INFO, logger="redline"):
        serve_cli._say("ready: warm-up done")
        serve_cli._say("stopped: every accepted request was answered")
    assert not isinstance(sys.stdout, ReaderGone), "stdout still points at the pipe nobody reads"
    assert caplog.text.count("stdout's reader is gone; the server serves on") == 1


TINY = """
from torch import nn
from redline.serve.servable import Servable


def make():
    return Servable(model=nn.Linear(3, 2), input_shape=(3,))
"""


@pytest.mark.slow
def test_redline_serve_whose_stdout_reader_exited_serves_on_and_exits_0_on_sigterm(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    command = [sys.executable, "-m", "redline", "serve", f"{tmp_path / 'tiny.py'}:make", "--port", "0",
               "--device", "cpu", "--measure", "off", "--compile", "off", "--max-batch-size", "2"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = next((line.split()[2] for line in process.stdout if line.startswith("listening on ")), None)
        assert url, process.stderr.read()
        process.stdout.close()  # the reader exits, as `grep -m1` does, before the server says it is ready
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(url + "/readyz", timeout=5).status == 200:
                    break
            except OSError:  # not listening, or 503 while warming up
                assert process.poll() is None, f"the server stopped: {process.stderr.read()}"
                assert time.monotonic() < deadline, "the server never became ready"
                time.sleep(0.05)
        body = b'{"inputs": [1, 2, 3]}'
        request = urllib.request.Request(url + "/v1/predict", data=body, headers={"content-type": "application/json"})
        answered = urllib.request.urlopen(request, timeout=30).status
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
    assert answered == 200
    assert process.returncode == 0, err  # Python's flush of stdout at exit would fail too: 120, and a traceback
    assert "stdout's reader is gone; the server serves on" in err
    assert "Traceback" not in err and "Exception ignored" not in err and "error:" not in err, err
