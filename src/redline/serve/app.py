"""The HTTP app: a Starlette app around an InferenceEngine, with dynamic batching, probes, metrics and a schema.

    app = build_app(engine, ServeOptions(max_wait_ms=5))  # up to the engine's max_batch_size per batch
    # uvicorn.run(app) or redline.serve.server.serve(engine, options)

``POST /v1/predict`` takes ``{"inputs": [...]}`` (JSON) or a .npy array (application/octet-stream)
and answers ``{"outputs": [...]}``; ``/livez``, ``/readyz``, ``/metrics`` and ``/openapi.json``
complete it. Every refusal is JSON ``{"error": message, "reason": word, ...}`` with its status:
401 token, 408 a body still arriving at the deadline, 413 body size, 400/415/422 input, 503 full queue,
not ready or stopped at once, 504 deadline, 500 model (or redline), 499 (counted, never read) a client that
hung up before its answer, and off the routes 404 (no such path: the endpoints listed) and 405 (a method the
path does not take).
The engine's warm-up runs when the app starts (its lifespan); /readyz answers 200 after it. An app whose
lifespan does not run (mounted inside another app, or served with the lifespan off) starts its worker and
warm-up at its first request, /readyz's included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import orjson
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from redline.serve.dispatch import RETRY_AFTER_S, Dispatcher
from redline.serve.inputs import NPY_MAGIC, InputSpec, read_json, read_npy
from redline.serve.metrics import ServeMetrics
from redline.serve.openapi import openapi_document
from redline.serve.options import ServeOptions
from redline.serve.refused import Refused

log = logging.getLogger("redline")

JSON_TYPES = ("application/json", "")  # no Content-Type: read as JSON (as .npy where it starts as one)
NPY_TYPES = ("application/octet-stream", "application/x-npy")
# The refusals of queued requests: the latency histogram times them (not those refused at the door).
QUEUED_REFUSALS = ("model_error", "internal_error", "timeout")
PARSED_ASIDE = 1 << 20  # bytes: a body this large is read into a batch off the event loop
# The types curl sends for a form (-d, -F) unless told otherwise: the first requests of many a user.
FORM = "application/x-www-form-urlencoded"  # what curl -d and --data-binary send unless told
NPY_AS_FORM = (
    "; the body is a .npy array, which curl --data-binary sends as application/x-www-form-urlencoded unless told: "
    "add -H 'Content-Type: application/octet-stream'"
)
FORM_FIXES = {
    FORM: "; curl -d sends application/x-www-form-urlencoded unless told: add -H 'Content-Type: application/json'",
    "multipart/form-data": (
        "; send the array as the whole body, not a form's file: "
        "curl --data-binary @x.npy -H 'Content-Type: application/octet-stream'"
    ),
}
# A refusal sent before the body was read whole (408, 413) ends the connection: kept alive, it went on taking a slow
# client's bytes for the rest of a body nobody reads.
CLOSE = {"Connection": "close"}
# nginx's status for a client that closed its connection before the answer: no client ever reads it, but the
# metrics count it apart from the answers that were delivered.
CLIENT_CLOSED = 499


class Serving:
    """What the app's routes share: the engine, the dispatcher, the metrics, and whether it is draining."""

    def __init__(self, engine: Any, options: ServeOptions) -> None:
        options = options.for_engine(engine)
        self.engine = engine
        self.options = options
        self.token = options.token()
        self.spec = InputSpec(tuple(engine.input_shape), engine.servable.input_dtype, options.batch_limit)
        self.fits_in_body = samples_in_body(self.spec, options)
        if (note := body_limit_note(self.spec, options)) is not None:
            log.warning("%s", note)
        self.metrics = ServeMetrics(options.batch_limit, timeout_s=options.timeout_ms / 1000)
        self.dispatcher = Dispatcher(engine, options, self.metrics)
        self.draining = False
        servable = engine.servable
        self.openapi = orjson.dumps(
            openapi_document(self.spec, name=servable.name, token=self.token is not None,
                             description=str(servable.extra.get("description", "")),
                             max_body_mb=options.max_body_mb, timeout_ms=options.timeout_ms)
        )  # fmt: skip

    def begin_drain(self) -> None:
        """Turn /readyz to 503 (shutdown began); requests already here are still answered."""
        self.draining = True

    def abandon(self) -> int:
        """Stop now (a second Ctrl-C): answer every request queued or in the model 503, and return how many."""
        self.draining = True
        return self.dispatcher.abandon(
            lambda: Refused(
                503, "shutting_down",
                "the server was stopped at once (a second Ctrl-C) before this request was answered: send it again",
            )
        )  # fmt: skip

    def unusable(self) -> str | None:
        """Why the model cannot run any more (a sticky device error, a failed warm-up), or None."""
        return self.engine.broken or self.dispatcher.failed

    def check_token(self, request: Request) -> None:
        """Refuse (401) a request without the bearer token, when one is required; compare in constant time."""
        if self.token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # Header values arrive decoded as latin-1: encoding back gives the bytes sent, a UTF-8 token's included
        sent = given.strip().encode("latin-1")
        if scheme.lower() != "bearer" or not hmac.compare_digest(sent, self.token.encode()):
            raise Refused(
                401, "unauthorized", "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def read_body(self, request: Request) -> bytes:
        """Return the body, refusing (413) one over the limit by its Content-Length or by the bytes streamed."""
        limit = self.options.max_body_bytes
        fits, dtype = "", npy_dtype(self.spec)
        if self.fits_in_body == 0:
            fits = f" (a {dtype} .npy body of one sample is larger: only JSON whose numbers are written short fits)"
        elif self.fits_in_body < self.options.batch_limit:  # a request of max_batch_size samples is refused too
            fits = (
                f" (a {dtype} .npy body of up to {self.fits_in_body} samples fits; as JSON, as its numbers are written)"
            )
        too_large = Refused(
            413, "body_too_large", f"the body is larger than max_body_mb={self.options.max_body_mb:g} MiB{fits}",
            headers=dict(CLOSE),
        )  # fmt: skip
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise Refused(400, "bad_request", f"Content-Length {declared!r} is not a number of bytes")
            if int(declared) > limit:
                raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            raise _client_closed() from None
        return b"".join(chunks)

    async def read_body_by(self, request: Request, deadline: float) -> bytes:
        """Return the body, refusing (408) one still arriving at the request's deadline: a stalled upload holds
        no handler, nor its connection (closed after the answer), forever."""
        try:
            return await asyncio.wait_for(self.read_body(request), max(deadline - self.dispatcher.clock(), 0.0))
        except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11; two on 3.10
            raise Refused(
                408, "body_timeout",
                f"the body was still arriving timeout_ms={self.options.timeout_ms:g} after the request began; "
                "send it whole, without pausing (a large body on a slow link needs a server with a larger "
                "--timeout-ms)",
                headers=dict(CLOSE),
            ) from None  # fmt: skip

    async def answer_unless_gone(self, request: Request, inputs: Any, arrived: float) -> list[Any]:
        """Queue ``inputs`` and return their outputs; refuse (499) once the client hangs up before they come.

        The abandoned request leaves the queue (it never runs); one already running is not interrupted.
        """
        answer = asyncio.ensure_future(self.dispatcher.submit(inputs, arrived=arrived))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():  # the client left (or this handler was cancelled): stop waiting
                answer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await answer
        if answer.cancelled():
            raise _client_closed()
        return answer.result()

    async def predict(self, request: Request) -> Response:
        """POST /v1/predict: validate the inputs, queue them for a batch, answer with their outputs."""
        arrived = self.dispatcher.clock()
        try:
            self.check_token(request)
            if (reason := self.unusable()) is not None:
                raise Refused(503, "not_ready", f"the model cannot run: {reason}")
            self.dispatcher.start_unless_running()  # no lifespan started it: the app mounted inside another, say
            if not self.engine.ready:
                raise Refused(503, "not_ready", "the model is warming up", headers={"Retry-After": str(RETRY_AFTER_S)})
            media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
            if media not in JSON_TYPES + NPY_TYPES:
                fix = FORM_FIXES.get(media, "")
                if media == FORM:  # the fix depends on the body: a .npy array is told by its magic
                    body = await self.read_body_by(request, arrived + self.options.timeout_ms / 1000)
                    fix = NPY_AS_FORM if body.startswith(NPY_MAGIC) else fix
                raise Refused(
                    415, "unsupported_media_type",
                    f"Content-Type {media!r} is not read; send application/json or application/octet-stream (.npy)"
                    + fix,
                )  # fmt: skip
            coding = request.headers.get("content-encoding", "identity").strip().lower()
            if coding not in ("identity", ""):  # a compressed body would be read as broken JSON or .npy
                raise Refused(
                    415, "unsupported_media_type",
                    f"Content-Encoding {coding!r} is not read; send the body uncompressed (no Content-Encoding)",
                )  # fmt: skip
            body = await self.read_body_by(request, arrived + self.options.timeout_ms / 1000)
            if not body or body.isspace():  # curl -X POST without -d, say: the parsers would say "unexpected end"
                raise self.spec.refuse(400, 'the body is empty: send JSON {"inputs": [...]} or a .npy array')
            # Without a Content-Type (Python's requests.post(url, data=...) sends none) numpy's bytes are told by
            # their magic: no JSON text starts with them.
            as_npy = media in NPY_TYPES or (not media and body.startswith(NPY_MAGIC))
            parse = read_npy if as_npy else read_json
            if len(body) < PARSED_ASIDE:
                inputs = parse(body, self.spec)
            else:  # seconds of numpy work on a large JSON batch: the loop goes on answering /livez meanwhile
                inputs = await asyncio.to_thread(parse, body, self.spec)
            outputs = await self.answer_unless_gone(request, inputs, arrived)
            answer = _outputs_json(outputs)
        except Refused as refused:
            self.metrics.requests.labels(status=str(refused.status)).inc()
            if refused.reason in QUEUED_REFUSALS:  # not those refused at the door (a full queue's 503)
                self.metrics.latency_seconds.observe(self.dispatcher.clock() - arrived)
            return self.refuse(refused)
        self.metrics.requests.labels(status="200").inc()
        self.metrics.latency_seconds.observe(self.dispatcher.clock() - arrived)
        return answer

    def refuse(self, refused: Refused) -> Response:
        """The JSON answer of a refusal, counted by its reason: every refused request, on any path, is counted."""
        self.metrics.rejections.labels(reason=refused.reason).inc()
        return _json(refused.body(), refused.status, refused.headers)

    async def livez(self, request: Request) -> Response:
        """GET /livez: 503 once the model cannot run any more, so that an orchestrator restarts the server."""
        reason = self.unusable()
        if reason is not None:
            return _json({"status": "broken", "reason": reason}, 503)
        return _json({"status": "alive"}, 200)

    async def readyz(self, request: Request) -> Response:
        """GET /readyz: 200 when warmed up and not draining; an app whose lifespan did not run starts its worker
        (and the warm-up) here or at its first request."""
        reason = self.unusable()
        if reason is not None:
            return _json({"status": "broken", "reason": reason}, 503)
        if self.draining:
            return _json({"status": "draining"}, 503)
        self.dispatcher.start_unless_running()
        if not self.engine.ready:
            return _json({"status": "warming_up"}, 503)
        return _json({"status": "ready"}, 200)

    async def metrics_page(self, request: Request) -> Response:
        """GET /metrics: Prometheus' text format."""
        try:
            self.check_token(request)
        except Refused as refused:
            return self.refuse(refused)
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def openapi_page(self, request: Request) -> Response:
        """GET /openapi.json: the OpenAPI 3 document."""
        return Response(self.openapi, media_type="application/json")


def npy_dtype(spec: InputSpec) -> str:
    """The dtype of a .npy body of ``spec``'s samples: its own, float32 for bfloat16 (which .npy lacks)."""
    return "float32" if spec.dtype == "bfloat16" else spec.dtype


def npy_bytes(samples: int, spec: InputSpec) -> int:
    """The size of a .npy body of ``samples`` samples in ``npy_dtype(spec)``."""
    dtype = np.dtype(npy_dtype(spec))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (samples, *spec.shape)}
    )
    return len(header.getvalue()) + samples * math.prod(spec.shape) * dtype.itemsize


def samples_in_body(spec: InputSpec, options: ServeOptions) -> int:
    """The most samples (up to max_batch_size) a .npy body within max_body_mb holds, in ``spec``'s dtype."""
    full, sample = npy_bytes(options.batch_limit, spec), npy_bytes(1, spec) - npy_bytes(0, spec)
    if full <= options.max_body_bytes:
        return options.batch_limit
    header = full - options.batch_limit * sample  # that of fewer samples is no longer
    return max(options.max_body_bytes - header, 0) // sample


def body_limit_note(spec: InputSpec, options: ServeOptions) -> str | None:
    """Why a request of max_batch_size samples cannot pass the body limit (always a 413), or None where it can.

    A smaller request still can, and several of them still make one batch of up to max_batch_size.
    """
    full, fits = npy_bytes(options.batch_limit, spec), samples_in_body(spec, options)
    if fits >= options.batch_limit:
        return None
    dtype = npy_dtype(spec)
    shape = ", ".join(map(str, spec.shape)) + "," * (len(spec.shape) == 1)
    said = (
        f"a request of --max-batch-size {options.batch_limit} samples of shape ({shape}) is {_mib(full)} MiB as a "
        f"{dtype} .npy body (as JSON, as its numbers are written), over --max-body-mb {options.max_body_mb:g}: it is "
        "refused with 413"
    )
    raise_to = f"--max-body-mb {_mib(full, up=True)} lets a request of {options.batch_limit} samples in"
    if fits == 0:
        one = _mib(npy_bytes(1, spec))
        return (
            f"{said}, and so is a .npy request of one sample ({one} MiB): only JSON whose numbers are written short "
            f"can pass\nhint: {raise_to}"
        )
    return (
        f"{said}; a .npy request holds at most {fits} samples, and batches of up to "
        f"{options.batch_limit} form from several requests\nhint: {raise_to}, or --max-batch-size {fits} refuses "
        "a larger request with 422, which names the limit"
    )


def _mib(size: int, *, up: bool = False) -> str:
    """``size`` bytes in MiB, to three significant digits; ``up``: rounded up, a limit that lets it in."""
    mib = size / 2**20
    if not up:
        return f"{mib:.3g}"
    step = 10.0 ** (math.floor(math.log10(mib)) - 2)
    return f"{math.ceil(mib / step) * step:.3g}"


def build_app(engine: Any, options: ServeOptions | None = None) -> Starlette:
    """Return the Starlette app serving ``engine``; ``app.state.serving`` holds its Serving.

    Without ``options``, the defaults; ``max_batch_size`` left out (None) is the engine's own.

    The engine's warm-up (when it is not ready yet) and the batching worker start with the app's
    lifespan; at its end the queue is answered before the worker stops. Without a lifespan (the app
    mounted inside another, whose lifespan does not run this one's) they start at the first request.
    """
    serving = Serving(engine, options or ServeOptions())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        serving.draining = False
        serving.dispatcher.start()
        try:
            yield
        finally:
            serving.begin_drain()
            await serving.dispatcher.close()

    routes = [
        Route("/v1/predict", serving.predict, methods=["POST"]),
        Route("/livez", serving.livez, methods=["GET"]),
        Route("/readyz", serving.readyz, methods=["GET"]),
        Route("/metrics", serving.metrics_page, methods=["GET"]),
        Route("/openapi.json", serving.openapi_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=off_route_answers(routes, serving.refuse))
    # Starlette answers /v1/predict/ with a 307 to /v1/predict: a client may not resend its body there, and one that
    # does pays a second round trip on every request. A 404 naming the path is told once and fixed.
    app.router.redirect_slashes = False
    app.state.serving = serving
    return app


def off_route_answers(
    routes: Sequence[Route], refuse: Callable[[Refused], Response]
) -> dict[int, Callable[[Request, Exception], Awaitable[Response]]]:
    """The app's handlers of a request no route takes: JSON refusals answered (and counted) by ``refuse``.

    404 lists the endpoints; 405 names the methods the path takes and keeps Starlette's Allow
    header (in a stable order: Starlette joins a set).
    """
    # HEAD, which Starlette adds to every GET route, is left out of the list
    endpoints = ", ".join(
        f"{method} {route.path}" for route in routes for method in sorted((route.methods or set()) - {"HEAD"})
    )

    takes = {route.path: sorted((route.methods or set()) - {"HEAD"}) for route in routes}

    async def not_found(request: Request, exc: Exception) -> Response:
        path = request.url.path
        where = f"{request.method} {path}"
        meant = path.rstrip("/")
        slash = meant != path and meant in takes
        # the route's own method: GET /v1/predict/ (curl without -d) means POST /v1/predict, not a 405
        method = request.method if request.method in takes.get(meant, ()) else " or ".join(takes.get(meant, ()))
        hint = f"did you mean {method} {meant} (no trailing slash)? " if slash else ""
        return refuse(Refused(404, "not_found", f"{where}: no such endpoint; {hint}this server answers {endpoints}"))

    async def method_not_allowed(request: Request, exc: Exception) -> Response:
        headers = (exc.headers if isinstance(exc, HTTPException) else None) or {}
        allowed = sorted(method.strip() for method in headers.get("Allow", "").split(",") if method.strip())
        path = request.url.path
        message = f"{request.method} {path}: method not allowed; {path} takes {' or '.join(allowed)}"
        return refuse(Refused(405, "method_not_allowed", message, headers={**headers, "Allow": ", ".join(allowed)}))

    return {404: not_found, 405: method_not_allowed}


def _client_closed() -> Refused:
    return Refused(CLIENT_CLOSED, "client_closed_request", "the client closed the connection before its answer")


async def _disconnected(request: Request) -> None:
    """Return once the client has closed its connection (the body was read: nothing else comes before that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _outputs_json(outputs: list[Any]) -> Response:
    """The 200 answer; outputs that are not JSON (a postprocess returning sets or objects, say) fail as the model's
    error. Tensors are written as numpy arrays are: a postprocess returning ``scores.argmax(1)`` is answered."""
    try:
        body = orjson.dumps({"outputs": outputs}, default=_tensor_as_list, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:  # orjson.JSONEncodeError is a TypeError
        log.warning("a request's outputs are not JSON (%s): postprocess must return numbers, lists, dicts, arrays or "
                    "tensors; it was answered 500", exc)  # fmt: skip
        raise Refused(
            500, "model_error",
            f"the outputs are not JSON ({exc}); postprocess must return numbers, lists, dicts, arrays or tensors",
        ) from None  # fmt: skip
    return Response(body, status_code=200, media_type="application/json")


def _tensor_as_list(value: Any) -> Any:
    """A tensor as the number or nested lists it holds (orjson's ``default``); anything else stays unserialisable.

    So is an array orjson does not write itself: a view that is not C-contiguous (``scores[:, ::-1]``), or of a
    dtype it lacks (float16).
    """
    if isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


def _json(body: Any, status: int, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status, headers=headers,
        media_type="application/json",
    )  # fmt: skip
