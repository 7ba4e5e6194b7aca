"""The server's OpenAPI 3 document, written from the Servable's input shape and dtype and every answer it gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from redline.serve.inputs import InputSpec
from redline.serve.servable import shape_text
from redline.version import __version__

# What no path's responses can say: the answers to a request that matches no path, or no method of one.
ERRORS = (
    'Every error answer is JSON {"error": message, "reason": word}: those listed under each path, and '
    "404 (reason not_found) for a path this server does not have, 405 (method_not_allowed) for a method "
    "a path does not take, its Allow header listing those it does."
)


def openapi_document(
    spec: InputSpec,
    *,
    name: str,
    token: bool,
    description: str = "",
    max_body_mb: float | None = None,
    timeout_ms: float | None = None,
) -> dict[str, Any]:
    """Return the OpenAPI 3.0 document of a server for a model taking ``spec``'s inputs (``token``: bearer auth).

    ``max_body_mb`` and ``timeout_ms``, when given, are the server's limits, stated where they refuse.
    """
    body_limit = f"{max_body_mb:g} MiB (--max-body-mb)" if max_body_mb is not None else "(--max-body-mb)"
    timeout = f"{timeout_ms:g} ms (--timeout-ms)" if timeout_ms is not None else "(--timeout-ms)"
    sample = sample_schema(spec)
    inputs = {
        "oneOf": [sample, {"type": "array", "items": sample, "minItems": 1, "maxItems": spec.max_batch_size}],
        "description": f"One sample, or a list of up to {spec.max_batch_size} samples.",
    }
    predict_errors = {
        "400": _error("The body is not valid JSON, or not a .npy array."),
        "408": _error(f"The body was still arriving at the server's timeout, {timeout}, after the request began."),
        "413": _error(f"The body is larger than the server's limit, {body_limit}."),
        "415": _error(
            "The Content-Type is neither application/json nor application/octet-stream, or the body is compressed."
        ),
        "422": _error("The inputs' shape, dtype, values or number of samples do not fit the model."),
        "500": _error(
            "The model raised on this request (model_error), or redline's own code failed (internal_error); "
            "the server goes on."
        ),
        "503": _error(
            "The queue is full (Retry-After says when to retry), the model is not ready, or the server was stopped "
            "at once before answering.",
            retry=True,
        ),
        "504": _error(f"No answer within the server's timeout, {timeout}, of the request's arrival."),
    }
    secured = {"401": _error("The bearer token is missing or wrong.")} if token else {}
    predict: dict[str, Any] = {
        "summary": f"Run {name} on one sample or a batch of samples.",
        "operationId": "predict",
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {
                    "schema": {"type": "object", "required": ["inputs"], "properties": {"inputs": inputs}}
                },
                "application/octet-stream": {  # OpenAPI 3.0's media type holds no description: its schema does
                    "schema": {
                        "type": "string",
                        "format": "binary",
                        "description": (
                            f"A .npy array (numpy.save) of shape {_shape(spec)}, or of one sample; read alike as "
                            "application/x-npy, or without a Content-Type."
                        ),
                    },
                },
            },
            **({"description": f"At most {body_limit}."} if max_body_mb is not None else {}),
        },
        "responses": {
            "200": {
                "description": "One output per sample, in the order of the inputs.",
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": ["outputs"],
                            "properties": {"outputs": {"type": "array", "items": {}}},
                        }
                    }
                },
            },
            **secured,
            **predict_errors,
        },
    }
    if token:
        predict["security"] = [{"bearer": []}]
    paths: dict[str, Any] = {
        "/v1/predict": {"post": predict},
        "/livez": {
            "get": _probe(
                "Liveness: 200 unless the model's device is unusable or its warm-up failed.",
                "Not live: the model's device is unusable or its warm-up failed (restart the server).",
            )
        },
        "/readyz": {
            "get": _probe(
                "Readiness: 200 once warmed up, 503 before that and while shutting down.",
                "Not ready: still warming up, or shutting down.",
            )
        },
        "/metrics": {"get": _metrics(secured)},
        "/openapi.json": {
            "get": {
                "summary": "This document.",
                "operationId": "openapi",
                "responses": {"200": {"description": "OpenAPI 3.0", "content": {"application/json": {"schema": {}}}}},
            }
        },
    }
    document: dict[str, Any] = {
        "openapi": "3.0.3",
        "info": {
            "title": f"redline serve: {name}",
            "version": __version__,
            "description": (f"Inputs: {spec.describe()}. {ERRORS} " + description).strip(),
        },
        "paths": paths,
    }
    if token:
        document["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
    return document


def sample_schema(spec: InputSpec) -> dict[str, Any]:
    """The JSON schema of one sample: nested arrays of exactly ``spec.shape``, of values the dtype holds."""
    schema: dict[str, Any] = _value_schema(spec.dtype)
    for size in reversed(spec.shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def _value_schema(dtype: str) -> dict[str, Any]:
    if dtype == "bool":
        return {"type": "boolean"}
    if dtype in ("float32", "float16", "bfloat16", "float64"):
        largest = float(torch.finfo(getattr(torch, dtype)).max)
        return {"type": "number", "minimum": -largest, "maximum": largest}
    info = np.iinfo(dtype)
    return {"type": "integer", "minimum": int(info.min), "maximum": int(info.max)}


def _shape(spec: InputSpec) -> str:
    return shape_text(("N", *spec.shape))


def _error(description: str, *, retry: bool = False) -> dict[str, Any]:
    body = {
        "type": "object",
        "required": ["error", "reason"],
        "properties": {"error": {"type": "string"}, "reason": {"type": "string"}},
    }
    answer: dict[str, Any] = {"description": description, "content": {"application/json": {"schema": body}}}
    if retry:
        answer["headers"] = {
            "Retry-After": {"description": "Seconds to wait (a full queue).", "schema": {"type": "integer"}}
        }
    return answer


def _probe(summary: str, refused: str) -> dict[str, Any]:
    status = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    content = {"application/json": {"schema": status}}
    return {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": content},
            "503": {"description": refused, "content": content},
        },
    }


def _metrics(secured: dict[str, Any]) -> dict[str, Any]:
    return {
        "summary": "Prometheus metrics: queue, compute and end-to-end time, batch sizes, answers and refusals.",
        "responses": {
            "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **secured,
        },
        **({"security": [{"bearer": []}]} if secured else {}),
    }
