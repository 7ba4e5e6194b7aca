"""The server against its own /openapi.json: schemathesis sends valid and invalid requests; none may crash it."""

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance
from serve_engines import linear_engine

from redline.serve.app import build_app
from redline.serve.options import ServeOptions

ENGINE = linear_engine(max_batch_size=4)
ENGINE.warm_up()  # ready from the first request, so that every example reaches the model
APP = build_app(ENGINE, ServeOptions(max_batch_size=4, max_wait_ms=1, max_body_mb=1))

schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_every_answer_matches_the_document_and_none_is_a_server_error(case):
    # Any bytes fit `format: binary`, though few are a .npy array: a 400 is the right answer there.
    binary = case.media_type == "application/octet-stream"
    case.call_and_validate(excluded_checks=[positive_data_acceptance] if binary else [])


def test_the_document_is_valid_openapi_with_and_without_a_token(monkeypatch):
    # a description inside the .npy media type object made the whole requestBody invalid OpenAPI 3.0
    import orjson
    from openapi_spec_validator import validate

    monkeypatch.setenv("REDLINE_TEST_TOKEN", "a-token")
    for options in (ServeOptions(max_wait_ms=1), ServeOptions(max_wait_ms=1, token_env="REDLINE_TEST_TOKEN")):
        document = orjson.loads(build_app(ENGINE, options).state.serving.openapi)
        validate(document)  # raises, naming the path, where it is not
        assert document["paths"]["/readyz"]["get"]["responses"]["503"]["description"].startswith("Not ready: ")
