"""A request the server answers with an error status: why, and what the client should do."""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """An HTTP error answer: status, a reason word for the metrics, a message, and extra fields or headers.

    The body is ``{"error": message, "reason": reason, **fields}``.
    """

    def __init__(
        self,
        status: int,
        reason: str,
        message: str,
        *,
        fields: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.fields = fields or {}
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return {"error": self.message, "reason": self.reason, **self.fields}
