"""The server's answers off its routes: an unknown path (404) or method (405) is JSON like every other error."""

import httpx
import orjson
import pytest
from serve_client import metrics
from serve_engines import FakeEngine

from redline.errors import ConfigError
from redline.serve.app import build_app
from redline.serve.options import ServeOptions

pytestmark = pytest.mark.anyio

ENDPOINTS = ("POST /v1/predict", "GET /livez", "GET /readyz", "GET /metrics", "GET /openapi.json")


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def answer(method, path):
    app = build_app(FakeEngine(), ServeOptions(max_batch_size=8))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
        return await client.request(method, path)


async def test_an_unknown_path_is_a_json_404_listing_the_endpoints():
    got = await answer("POST", "/predict")
    assert got.status_code == 404 and got.headers["content-type"] == "application/json"
    error = got.json()
    assert error["reason"] == "not_found" and error["error"].startswith("POST /predict: no such endpoint")
    assert all(endpoint in error["error"] for endpoint in ENDPOINTS), error["error"]


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/predict", "POST"), ("PUT", "/v1/predict", "POST"), ("POST", "/livez", "GET, HEAD")],
)
async def test_a_method_the_path_does_not_take_is_a_json_405_naming_those_it_does(method, path, allow):
    got = await answer(method, path)
    assert got.status_code == 405 and got.headers["content-type"] == "application/json"
    assert got.headers["allow"] == allow, "the Allow header stays, in a stable order"
    error = got.json()
    assert error["reason"] == "method_not_allowed"
    assert error["error"] == f"{method} {path}: method not allowed; {path} takes {allow.replace(', ', ' or ')}"


async def test_the_schema_says_every_error_is_json_off_the_routes_too():
    described = orjson.loads(build_app(FakeEngine()).state.serving.openapi)["info"]["description"]
    assert "404" in described and "405" in described and '{"error": message, "reason": word}' in described


async def test_refusals_off_the_prediction_route_are_counted_by_reason_too(monkeypatch):
    monkeypatch.setenv("REDLINE_TEST_TOKEN", "s3cret")
    app = build_app(FakeEngine(), ServeOptions(max_batch_size=8, token_env="REDLINE_TEST_TOKEN"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
        for method, path in [("GET", "/nowhere"), ("POST", "/predict"), ("GET", "/v1/predict"), ("GET", "/metrics")]:
            assert (await client.request(method, path)).status_code in (401, 404, 405)
        page = await client.get("/metrics", headers={"authorization": "Bearer s3cret"})
    counted = {k: v for k, v in metrics(page.text).items() if k.startswith("redline_serve_rejections_total")}
    assert counted == {
        'redline_serve_rejections_total{"reason": "not_found"}': 2,
        'redline_serve_rejections_total{"reason": "method_not_allowed"}': 1,
        'redline_serve_rejections_total{"reason": "unauthorized"}': 1,
    }


@pytest.mark.parametrize(
    ("method", "path", "meant"), [("POST", "/v1/predict/", "/v1/predict"), ("GET", "/readyz/", "/readyz")]
)
async def test_a_trailing_slash_is_a_404_naming_the_path_not_a_redirect_a_post_may_not_follow(method, path, meant):
    got = await answer(method, path)
    assert got.status_code == 404 and "location" not in got.headers
    error = got.json()
    assert error["reason"] == "not_found"
    assert error["error"].startswith(f"{method} {path}: no such endpoint; did you mean {method} {meant}")


async def test_options_that_leave_the_batch_size_out_take_the_engines():
    # ServeOptions(port=0) was refused for the 32 the user never set: "max_batch_size=32 is not allowed"
    app = build_app(FakeEngine(max_batch_size=8), ServeOptions(port=0))
    assert app.state.serving.options.max_batch_size == 8 and app.state.serving.spec.max_batch_size == 8
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as client:
        fits = await client.post("/v1/predict", json={"inputs": [[0.0] * 3] * 8})
        over = await client.post("/v1/predict", json={"inputs": [[0.0] * 3] * 9})
    assert fits.status_code == 200, fits.text
    assert over.status_code == 422 and "more than max_batch_size=8 in one request" in over.json()["error"]
    with pytest.raises(ConfigError) as refused:  # one set above the engine's says both fixes
        build_app(FakeEngine(max_batch_size=8), ServeOptions(max_batch_size=32))
    assert str(refused.value) == (
        "max_batch_size=32 is not allowed; expected at most the engine's max_batch_size=8\n"
        "hint: pass ServeOptions(max_batch_size=8) or leave it out (the engine's), or build the InferenceEngine "
        "with max_batch_size=32"
    )
