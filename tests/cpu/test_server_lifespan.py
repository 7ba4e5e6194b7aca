"""An app whose lifespan never runs (mounted inside another app, or a test client outside ``with``) still serves:
its batching worker and warm-up start at its first request, where its requests once waited for their 504."""

import threading
import time
import warnings

from serve_engines import FakeEngine
from starlette.applications import Starlette
from starlette.routing import Mount

from redline.serve.app import build_app
from redline.serve.options import ServeOptions

with warnings.catch_warnings():  # Starlette 1.x asks for httpx2 in place of httpx, which works as well
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


def model_threads():
    return [t.name for t in threading.enumerate()].count("redline-model")


def ready_within(client, path, seconds=10.0):
    deadline = time.monotonic() + seconds
    while (answer := client.get(path)).status_code != 200:
        assert time.monotonic() < deadline, f"never ready: {answer.json()}"
        time.sleep(0.01)
    return answer


def test_an_app_mounted_inside_another_warms_up_and_answers_though_its_own_lifespan_never_runs():
    engine = FakeEngine(ready=False)
    served = build_app(engine, ServeOptions(max_batch_size=8, timeout_ms=5000))
    outer = Starlette(routes=[Mount("/model", app=served)])
    with TestClient(outer) as client:  # the outer app's lifespan runs; the mounted app's does not
        ready_within(client, "/model/readyz")
        started = time.monotonic()
        answer = client.post("/model/v1/predict", json={"inputs": [1, 2, 3]})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"outputs": [[2.0, 4.0, 6.0]]}
    assert time.monotonic() - started < 2.0, "answered at once, not at its deadline"


def test_a_test_client_outside_with_gets_its_answers_from_one_model_thread():
    engine = FakeEngine()
    before = model_threads()
    client = TestClient(build_app(engine, ServeOptions(max_batch_size=8, timeout_ms=5000)))
    answers = [client.post("/v1/predict", json={"inputs": [i, i, i]}) for i in range(3)]  # a loop of its own each
    assert [a.status_code for a in answers] == [200, 200, 200], answers[0].text
    assert [a.json()["outputs"] for a in answers] == [[[2.0 * i] * 3] for i in range(3)]
    assert engine.threads == {"redline-model"}
    assert model_threads() - before == 1, "one thread, not one per loop"


class CountedWarmUps(FakeEngine):
    def __init__(self, **options):
        super().__init__(**options)
        self.warm_ups = 0

    def warm_up(self, stop=None):
        self.warm_ups += 1
        super().warm_up(stop)


def test_readyz_of_an_app_without_a_lifespan_starts_the_warm_up_once_and_then_says_ready():
    engine = CountedWarmUps(ready=False)
    engine.warm_gate.clear()
    client = TestClient(build_app(engine, ServeOptions(max_batch_size=8)))
    assert client.get("/readyz").json() == {"status": "warming_up"}
    # each request's loop ends with it: the next worker finds the warm-up still running, and waits for it
    assert client.get("/readyz").json() == {"status": "warming_up"}
    engine.warm_gate.set()
    assert ready_within(client, "/readyz").json() == {"status": "ready"}
    assert client.post("/v1/predict", json={"inputs": [1, 1, 1]}).status_code == 200
    assert engine.warm_ups == 1, "warmed up once, not once per worker"
