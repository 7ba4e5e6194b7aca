"""What a load test sends (serve/loadtest.py): a request body read from a file, and the headers given."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from redline.errors import invalid
from redline.serve.inputs import NPY_MAGIC

# RFC 9110's token: what a header's name and a method are made of (no space, no separator, ASCII only)
TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def is_token(text: str) -> bool:
    """Whether ``text`` is an HTTP token, as a header's name and a method must be."""
    return bool(text) and set(text) <= TOKEN_CHARS


def parse_headers(headers: Sequence[str]) -> dict[str, str]:
    """Return ``K:V`` strings as a mapping; a string without a name and a colon, a name that is not an HTTP token,
    or a value holding a line break or another control character is a clear error (the HTTP client would raise
    at the first request, mid-run)."""
    out = {}
    for text in headers:
        name, colon, value = text.partition(":")
        if not colon or not is_token(name.strip()):
            raise invalid(
                "header", text, "NAME:VALUE, the name a token (letters, digits and !#$%&'*+-.^_`|~)",
                "e.g. --header 'Authorization: Bearer TOKEN'",
            )  # fmt: skip
        if any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in value):
            raise invalid(
                "header", text, "NAME:VALUE on one line: a line break or another control character in a value "
                "would end the header there", "remove the line break (a token pasted from a file often ends in one)",
            )  # fmt: skip
        out[name.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class Payload:
    """A request body and its content type."""

    body: bytes
    content_type: str

    @classmethod
    def from_file(cls, path: Path) -> Payload:
        """Read a .json file (checked to parse) or a .npy array (checked by its magic bytes)."""
        suffix = path.suffix.lower()
        if suffix not in (".json", ".npy"):
            raise invalid("payload", str(path), "a .json or .npy file", "save the body as body.json or array.npy")
        try:
            body = path.read_bytes()
        except OSError as exc:  # said as the other refusals are: by --payload on the command line
            raise invalid(
                "payload", str(path), "a readable .json or .npy file",
                f"it cannot be read ({exc.strerror or exc}): check the path and its permissions",
            ) from exc  # fmt: skip
        if suffix == ".json":
            try:
                json.loads(body)
            except ValueError as exc:
                raise invalid("payload", str(path), "a file holding valid JSON", f"it does not parse: {exc}") from exc
            return cls(body, "application/json")
        if not body.startswith(NPY_MAGIC):
            raise invalid("payload", str(path), "a .npy file as numpy.save writes it", "it lacks the .npy header")
        return cls(body, "application/octet-stream")
