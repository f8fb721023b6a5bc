"""ASGI plumbing of the proxy path: watch the client while awaiting the worker, and relay a
stream without buffering (the request body is read by sluice.api.body, shared with the
worker).

Both use one helper task per request that reads the ASGI ``receive`` channel and, on
``http.disconnect``, cancels the request's own task (rather than running the work in a
second task and racing the two: fewer tasks, less CPU per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


class _DisconnectWatch:
    """Cancels the current task when the client disconnects, until ``stop``.

    Single-threaded safety: the watcher only cancels while ``stopped`` is False, and the
    watched task sets it (in ``stop``) before its next await, so a cancellation never lands
    after the watched work is over.
    """

    def __init__(self, receive: Receive):
        self.task = asyncio.current_task()
        self.gone = False
        self.stopped = False
        self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.stopped:
            self.gone = True
            self.task.cancel()

    def stop(self) -> None:
        self.stopped = True
        self.watcher.cancel()

    def absorb(self) -> bool:
        """After a CancelledError: True (and the cancellation is consumed) when it was the
        client leaving."""
        if self.gone:
            self.task.uncancel()
            return True
        return False


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ClientDisconnected. Must only be called after the request body has been read."""
    watch = _DisconnectWatch(receive)
    try:
        return await work
    except asyncio.CancelledError:
        if watch.absorb():
            raise ClientDisconnected from None
        raise
    finally:
        watch.stop()


class RelayResponse(Response):
    """Streams an async byte iterator; stops it as soon as the client disconnects.

    Unlike Starlette's StreamingResponse this always closes the iterator (running its
    ``finally``) on every exit path, including a disconnect before the first chunk.
    """

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 on_disconnect: Callable[[], None] = lambda: None):
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _DisconnectWatch(receive)
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            self.on_disconnect()
        except OSError:  # the client's socket went away under a send
            self.on_disconnect()
        finally:
            watch.stop()
            await self.chunks.aclose()
