"""A request's head (its request line and headers) is bounded as its body is: one too large is answered 431, one
that stops arriving (or never starts) 408 at the deadline, and either connection is closed; a kept-alive connection
idle between requests is left to uvicorn's own keep-alive timeout."""

import json
import socket
import time

from serve_client import uvicorn_serving
from serve_engines import FakeEngine

from redline.serve.app import build_app
from redline.serve.guard import HEAD_LIMIT, GuardedHead, guarded_http
from redline.serve.options import ServeOptions
from redline.serve.server import _http


def guarded_serving(timeout_s):
    """A FakeEngine's app under uvicorn with the guarded protocol, in a thread; yields its port."""
    app = build_app(FakeEngine(), ServeOptions(timeout_ms=timeout_s * 1000))
    return uvicorn_serving(app, guarded_http(timeout_s))


def answer(client, within_s=5.0):
    """What the server sends until it closes the connection (or ``within_s`` passes)."""
    client.settimeout(0.05)
    received, deadline = b"", time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            chunk = client.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            return received, True
        received += chunk
    return received, False


def refusal(received):
    head, _, body = received.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], head.lower(), json.loads(body)


def test_a_head_larger_than_the_limit_is_answered_431_and_closed():
    with guarded_serving(5.0) as port, socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (HEAD_LIMIT + 1024))
        received, closed = answer(client)
    status, head, body = refusal(received)
    assert status == b"HTTP/1.1 431 Request Header Fields Too Large" and closed
    assert b"connection: close" in head and body["reason"] == "headers_too_large"
    assert str(HEAD_LIMIT) in body["error"]


def test_a_head_that_stops_arriving_or_never_starts_is_answered_408_at_the_deadline():
    with guarded_serving(0.3) as port:
        for sent in (b"GET /livez HTTP/1.1\r\nHost: x\r\n", b""):  # half a head; nothing at all
            with socket.create_connection(("127.0.0.1", port)) as client:
                started = time.monotonic()
                client.sendall(sent)
                received, closed = answer(client)
            status, _, body = refusal(received)
            assert status == b"HTTP/1.1 408 Request Timeout" and closed, received
            assert body["reason"] == "head_timeout" and "300 ms" in body["error"]
            assert 0.25 < time.monotonic() - started < 3.0


def test_a_kept_alive_connection_idle_between_requests_and_a_large_body_are_not_taken_for_a_stalled_head():
    with guarded_serving(0.3) as port, socket.create_connection(("127.0.0.1", port)) as client:
        statuses = []
        for pause in (0, 0.6):  # longer than the head's bound, shorter than uvicorn's 5 s keep-alive
            time.sleep(pause)
            client.sendall(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
            client.settimeout(3)
            statuses.append(client.recv(65536).split(b"\r\n")[0])
        inputs = json.dumps({"inputs": [[1.0, 2.0, 3.0]] * 8}).encode() + b" " * (HEAD_LIMIT * 2)  # sent in one go
        client.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(inputs), inputs))  # fmt: skip
        statuses.append(client.recv(65536).split(b"\r\n")[0])
    assert statuses == [b"HTTP/1.1 200 OK"] * 3


def test_serve_runs_the_guarded_protocol_with_the_requests_deadline():
    http = _http(2.5)
    assert isinstance(http, type) and issubclass(http, GuardedHead) and http.timeout_s == 2.5
