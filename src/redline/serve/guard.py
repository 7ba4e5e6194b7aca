"""Bounds on a request's head (its request line and headers), which uvicorn's httptools protocol leaves open.

uvicorn bounds a body (the app does: ``--max-body-mb``, ``--timeout-ms``) and an idle kept-alive connection, but not
the head before it: one client sending a 120 MiB header grew the server by 300 MB and held every other request up to
27 s while it arrived, and connections that sent part of a head, or nothing, were held for good (a few hundred used
up the process's file descriptors). ``guarded_http`` is uvicorn's httptools protocol with two bounds, as a proxy in
front (nginx) would set: a head larger than ``HEAD_LIMIT`` bytes is answered 431, and one not whole ``timeout_s``
after its first byte (or after the connection opened) 408; either closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # this module imports only where it is installed

log = logging.getLogger("redline")

HEAD_LIMIT = 64 * 1024  # bytes: nginx takes 4 buffers of 8 KiB by default, Node 16 KiB; a bearer token fits


class GuardedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head bounded: ``HEAD_LIMIT`` bytes, whole ``timeout_s`` after it began."""

    timeout_s: ClassVar[float] = 10.0
    _reading_head, _head_bytes, _fresh = True, 0, True
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._start_head_timer()  # a connection that sends nothing is held no longer than a stalled head

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            if self._head_bytes == 0 and not self._fresh:
                self._start_head_timer()  # the next request of a kept-alive connection began
            self._head_bytes += len(data)
        super().data_received(data)  # on_headers_complete ends the head, if it is whole
        if self._reading_head and self._head_bytes > HEAD_LIMIT and not self.transport.is_closing():
            self._refuse(431, "headers_too_large", f"the request line and headers pass {HEAD_LIMIT} bytes")

    def on_headers_complete(self) -> None:
        self._reading_head, self._fresh = False, False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head, self._head_bytes = True, 0  # the next request's head, when it comes

    def _start_head_timer(self) -> None:
        self._stop_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(self.timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._reading_head and (self._head_bytes or self._fresh) and not self.transport.is_closing():
            waited = f"{self.timeout_s * 1000:g} ms"
            self._refuse(408, "head_timeout", f"the request line and headers were not whole {waited} after they began")

    def _refuse(self, status: int, reason: str, said: str) -> None:
        body = orjson.dumps({"error": said, "reason": reason})
        phrase = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}[status]
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        self._stop_head_timer()
        self._reading_head = False
        self.transport.write(head % (status, phrase, len(body)) + body)
        self.transport.close()
        log.debug("refused a request's head with %d: %s", status, said)


def guarded_http(timeout_s: float) -> type[GuardedHead]:
    """The protocol class for uvicorn's ``http``, its heads whole within ``timeout_s`` (the requests' deadline)."""
    return type("GuardedHead", (GuardedHead,), {"timeout_s": timeout_s})
