"""The HTTP server's options (one validated value, turned into `redline serve`'s flags), and the engine's checks."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from redline.config import non_negative_int, non_negative_number, option, positive_int, positive_number, with_changes
from redline.errors import ConfigError, DeviceUnavailableError, invalid
from redline.hardware.device import probe_accelerators
from redline.plan import Choice, parse_switch
from redline.plan.device import resolve_device
from redline.plan.inference import check_cuda_graphs, check_inference_precision, read_measure

DEFAULT_MAX_BATCH = 32  # InferenceEngine's max_batch_size, and `redline serve`'s


@dataclass(frozen=True, kw_only=True)
class ServeOptions:
    """How the server listens, batches, queues and refuses; ``build_app`` and ``redline serve`` take it."""

    host: str = option("127.0.0.1", "Address to listen on (0.0.0.0 for every interface).")
    port: int = option(8000, "Port to listen on (0: any free port, printed at start).", min=0)
    max_batch_size: int | None = option(
        None,
        f"Most samples run together in one batch (default: the engine's, {DEFAULT_MAX_BATCH} for `redline serve`); "
        "a larger request is refused (422).",
        min=1,
    )
    max_wait_ms: float = option(5.0, "Longest a batch waits for more requests, from its first request's arrival.")
    queue_size: int = option(
        256, "Most requests waiting for the model; more are refused with 503 and Retry-After.", min=1
    )
    timeout_ms: float = option(10_000.0, "Deadline of a request from its arrival; past it the answer is 504.")
    max_body_mb: float = option(16.0, "Largest request body in MiB; a larger one is refused with 413.")
    token_env: str | None = option(
        None, "Require `Authorization: Bearer TOKEN` on /v1/predict and /metrics, TOKEN read from this variable."
    )

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise invalid("host", self.host, "an address to listen on", "e.g. host='127.0.0.1'")
        non_negative_int("port", self.port)
        if self.port > 65535:
            raise invalid("port", self.port, "a port number from 0 to 65535", "port=0 picks any free port")
        positive_int("max_batch_size", self.max_batch_size, optional=True)
        wait_rule = "finite milliseconds >= 0 (0: never wait for more requests)"
        non_negative_number("max_wait_ms", self.max_wait_ms, wait_rule)  # NaN would wait forever
        positive_int("queue_size", self.queue_size)
        positive_number("timeout_ms", self.timeout_ms)
        if self.max_wait_ms >= self.timeout_ms:  # the batcher runs a batch before its requests' deadline: at once
            raise invalid(
                "max_wait_ms", self.max_wait_ms, f"less than timeout_ms={self.timeout_ms:g}",
                "a batch runs before its first request's deadline, so it would never wait for more requests: "
                f"e.g. max_wait_ms={min(5.0, self.timeout_ms / 2):g}",
            )  # fmt: skip
        positive_number("max_body_mb", self.max_body_mb)
        if self.token_env is not None and (not isinstance(self.token_env, str) or not self.token_env.isidentifier()):
            raise invalid(
                "token_env", self.token_env, "the name of an environment variable", "e.g. --token-env API_TOKEN"
            )

    @classmethod
    def build(cls, options: ServeOptions | None = None, **changes: Any) -> ServeOptions:
        """Return ``options`` (or the defaults) with ``changes``; an unknown name is a clear error."""
        return with_changes(cls, options, changes, what="a serve option")

    def for_engine(self, engine: Any) -> ServeOptions:
        """These options with the engine's ``max_batch_size`` where they leave it out; refused where theirs is
        larger than the engine's, whose largest bucket is the largest batch it was warmed up for."""
        if self.max_batch_size is None:
            return with_changes(ServeOptions, self, {"max_batch_size": engine.max_batch_size}, what="a serve option")
        if self.max_batch_size > engine.max_batch_size:
            allowed = f"at most the engine's max_batch_size={engine.max_batch_size}"
            hint = (
                f"pass ServeOptions(max_batch_size={engine.max_batch_size}) or leave it out (the engine's), or build "
                f"the InferenceEngine with max_batch_size={self.max_batch_size}"
            )
            raise invalid("max_batch_size", self.max_batch_size, allowed, hint)
        return self

    @property
    def batch_limit(self) -> int:
        """``max_batch_size`` once ``for_engine`` has resolved it (the engine's default where nothing resolved it)."""
        return DEFAULT_MAX_BATCH if self.max_batch_size is None else self.max_batch_size

    @property
    def max_body_bytes(self) -> int:
        """The body limit in bytes."""
        return int(self.max_body_mb * 2**20)

    def token(self) -> str | None:
        """Return the bearer token read from ``token_env`` (None when no token is asked for)."""
        if self.token_env is None:
            return None
        value = os.environ.get(self.token_env, "").strip()  # a token read from a file ends with a newline
        if not value:
            state = "empty" if self.token_env in os.environ else "unset"
            raise ConfigError(
                f"--token-env {self.token_env}: the variable is {state}, so no request could be let in\n"
                f"hint: export {self.token_env}=$(openssl rand -hex 32), or drop --token-env"
            )
        return value


def check_engine_options(
    *,
    device: str,
    precision: str,
    compile: str | bool,
    cuda_graphs: str | bool,
    measure: str | bool,
    channels_last: str | bool = "auto",
) -> None:
    """Refuse an engine option that cannot work here, before a model is built (the engine finds it only after).

    A device this machine lacks is a DeviceUnavailableError; a value no engine takes, or CUDA graphs
    asked of a device that is not CUDA, a ConfigError naming the argument.
    """
    chosen = resolve_device(device, probe_accelerators())
    check_inference_precision(precision)
    parse_switch("compile", compile)
    parse_switch("channels_last", channels_last)
    check_cuda_graphs(cuda_graphs, torch.device(chosen.value).type)
    read_measure(measure)


def engine_device(device: str) -> Choice[str]:
    """The device ``device`` names, its errors saying ``device=`` (the resolver says the Runtime's ``devices=``).

    check_engine_options keeps the resolver's word: the command line turns it into --device.
    """
    try:
        return resolve_device(device, probe_accelerators())
    except ConfigError as error:
        if error.parts is None or error.parts[0] != "devices":
            raise
        _, value, allowed, hint = error.parts
        raise invalid("device", value, allowed, hint.replace("devices=", "device=")) from None
    except DeviceUnavailableError as error:
        raise DeviceUnavailableError(str(error).replace("devices=", "device=")) from error.__cause__
