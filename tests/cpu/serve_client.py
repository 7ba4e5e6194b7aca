"""What the server's in-process tests share: the app running under an httpx client, and readers of its answers."""

import asyncio
import contextlib
import io
import json
import threading
import time

import httpx
import numpy as np
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from redline.serve.app import build_app
from redline.serve.options import ServeOptions
from redline.serve.server import bind, listen


@contextlib.asynccontextmanager
async def running(engine, **options):
    """The app started (its lifespan entered) with an httpx client talking to it in-process."""
    app = build_app(engine, ServeOptions(**{"max_batch_size": engine.max_batch_size, **options}))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://x") as client:
        yield client, app.state.serving


async def eventually(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the condition never came true"
        await asyncio.sleep(0.005)


async def fill_the_queue(client, engine, serving, waiting):
    """Send a request the held model takes, then ``waiting`` more that queue behind it (inputs 1, 2, ...)."""
    sent = [asyncio.create_task(client.post("/v1/predict", json={"inputs": [1, 1, 1]}))]
    await eventually(lambda: engine.threads)
    sent += [asyncio.create_task(client.post("/v1/predict", json={"inputs": [i] * 3})) for i in range(2, waiting + 2)]
    await eventually(lambda: serving.dispatcher.queued == waiting)
    return sent


async def ready(client):
    for _ in range(2000):
        if (await client.get("/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("never ready")


def npy(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def metrics(text):
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}  # fmt: skip


def reference(engine, inputs):
    with torch.no_grad():
        return engine.servable.model(torch.as_tensor(inputs, dtype=torch.float32))


@contextlib.contextmanager
def uvicorn_serving(app, http):
    """``app`` under a real uvicorn server in a thread; yields its port."""
    sock = bind("127.0.0.1", 0)
    listen(sock)
    server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server never started"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
