"""Clients that hang up before their answer: counted apart (499, as nginx does), never as a 200, never run when
still queued, and never an error in the server's log; and clients whose body stops arriving (408 at the deadline),
or is too large (413): either connection is closed after its answer, not held for a body nobody reads."""

import asyncio
import contextlib
import socket
import time

import pytest
from serve_client import eventually, metrics, uvicorn_serving
from serve_engines import FakeEngine

from redline.serve.app import build_app
from redline.serve.options import ServeOptions

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def hung_up(app, body, hang_up, *, more_body=False):
    """POST ``body`` to /v1/predict through ASGI (``more_body``: more announced, none sent), hang up once
    ``hang_up`` is set; return the status the app answered with (None if it answered nothing)."""
    messages = [{"type": "http.request", "body": body, "more_body": more_body}]

    async def receive():
        if messages:
            return messages.pop(0)
        await hang_up.wait()
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/predict", "raw_path": b"/v1/predict", "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    await app(scope, receive, send)
    return next((m["status"] for m in sent if m["type"] == "http.response.start"), None)


async def test_a_client_that_hangs_up_while_queued_is_counted_as_499_and_its_request_never_runs():
    engine = FakeEngine()
    engine.gate.clear()  # the model holds its first batch
    app = build_app(engine, ServeOptions(max_batch_size=1))
    async with app.router.lifespan_context(app):
        gone = asyncio.Event()
        first = asyncio.create_task(hung_up(app, b'{"inputs": [1, 1, 1]}', asyncio.Event()))
        await eventually(lambda: engine.threads)
        second = asyncio.create_task(hung_up(app, b'{"inputs": [2, 2, 2]}', gone))
        await eventually(lambda: app.state.serving.dispatcher.queued == 1)
        gone.set()
        assert await asyncio.wait_for(second, 5) == 499, "answered as soon as its client left"
        assert app.state.serving.dispatcher.queued == 0, "its place in the queue was freed"
        engine.gate.set()
        assert await first == 200
        page = metrics(app.state.serving.metrics.render().decode())
    assert engine.batches == [1], "the abandoned request never ran"
    assert page['redline_serve_requests_total{"status": "499"}'] == 1
    assert page['redline_serve_requests_total{"status": "200"}'] == 1
    assert page['redline_serve_rejections_total{"reason": "client_closed_request"}'] == 1


async def test_a_client_that_hangs_up_mid_body_is_counted_as_499_not_an_error():
    engine = FakeEngine()
    app = build_app(engine, ServeOptions(max_batch_size=1))
    gone = asyncio.Event()
    gone.set()
    async with app.router.lifespan_context(app):
        assert await hung_up(app, b'{"inputs": [1,', gone, more_body=True) == 499
        page = metrics(app.state.serving.metrics.render().decode())
    assert engine.batches == []
    assert page['redline_serve_requests_total{"status": "499"}'] == 1
    assert page['redline_serve_rejections_total{"reason": "client_closed_request"}'] == 1


async def test_a_body_that_stops_arriving_gets_408_at_the_deadline_not_a_handler_held_forever():
    engine = FakeEngine()
    app = build_app(engine, ServeOptions(max_batch_size=1, timeout_ms=200))
    async with app.router.lifespan_context(app):
        stalled = hung_up(app, b'{"inputs": [1,', asyncio.Event(), more_body=True)  # the rest never comes
        assert await asyncio.wait_for(stalled, 5) == 408
        page = metrics(app.state.serving.metrics.render().decode())
    assert engine.batches == []
    assert page['redline_serve_rejections_total{"reason": "body_timeout"}'] == 1


def trickled(port, declared_bytes, within_s=3.0):
    """Send a request declaring a body of ``declared_bytes``, then its bytes one at a time; return what came back
    and whether the server closed the connection (within ``within_s``; kept alive, it takes bytes until then)."""
    head = f"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared_bytes}"
    received, closed = b"", False
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.settimeout(0.05)
        client.sendall(head.encode() + b"\r\n\r\n[")
        deadline = time.monotonic() + within_s
        while not closed and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # once closed by the server, a send may fail
                client.sendall(b"1")
            try:
                chunk = client.recv(65536)
            except TimeoutError:
                continue
            except OSError:  # reset: closed with our bytes unread
                chunk = b""
            received += chunk
            closed = not chunk
    return received, closed


@pytest.mark.parametrize("http", ["h11", "httptools"])
def test_a_body_refused_408_or_413_closes_its_connection_so_a_trickling_client_holds_it_no_longer(http):
    app = build_app(FakeEngine(), ServeOptions(max_batch_size=1, timeout_ms=200, max_body_mb=0.01))
    with uvicorn_serving(app, http) as port:
        for declared, status in [(1000, b"408"), (100_000, b"413")]:  # 100_000 bytes: over the 10 KiB limit
            started = time.monotonic()
            received, closed = trickled(port, declared)
            assert received.startswith(b"HTTP/1.1 " + status), received
            assert b"\r\nconnection: close\r\n" in received.lower(), received
            assert closed and time.monotonic() - started < 2.0, "closed after the answer, not held for the body"
