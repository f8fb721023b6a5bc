"""Request bodies with a size limit, read as they arrive (the router and the worker).

A body over the limit is refused as soon as its ``Content-Length`` says so, or as soon as
the bytes read pass it: an oversized body is never held whole. The caller answers 413 with
``Connection: close`` (the rest of the body is not read).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect

MAX_BODY_BYTES = 16 * 1024 * 1024  # a full context of text is far smaller


class BodyTooLarge(Exception):
    """The request body is (or says it will be) longer than the limit."""


async def read_body(request: Any, limit: int) -> bytes:
    """The request body, read as it arrives and given up as soon as it passes ``limit``
    bytes (or its ``Content-Length`` says it will).

    Reads the ASGI ``receive`` channel itself (Starlette's ``request.stream()`` is an async
    generator, a few µs a request on the router's path); the body cannot be read again.

    Args:
        request: a Starlette request (``headers``, ``receive``), its body not read yet.
        limit: the most bytes accepted.

    Raises:
        BodyTooLarge: longer than ``limit`` bytes.
        starlette.requests.ClientDisconnect: the client left while sending it.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


__all__ = ["MAX_BODY_BYTES", "BodyTooLarge", "read_body"]
