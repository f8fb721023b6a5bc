"""ASGI plumbing of the proxy path: watch the client while awaiting the worker, and relay a
stream without buffering (the request body is read by sluice.api.body, shared with the
worker).

Both use one watch per request (``_DisconnectWatch``, made at the request's first wait and
kept in its ASGI scope) that, when the client leaves, cancels the request's own task while
it waits (rather than running the work in a second task and racing the two, or a new
watcher per wait). Under the router's own server protocol (``sluice.router.http``) the
server tells the watch itself, through the ASGI extension ``DISCONNECT_EXTENSION``; under
another server a helper task reads the ``receive`` channel for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import Response
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")
WATCH_KEY = "sluice.disconnect_watch"  # the request's _DisconnectWatch, in its ASGI scope
# scope["extensions"][DISCONNECT_EXTENSION](callback): the server calls callback() once, when
# the client leaves before the answer is complete (at once if it has left already)
DISCONNECT_EXTENSION = "sluice.disconnect"


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was complete."""


class _DisconnectWatch:
    """Watches one request's ``receive`` channel for the client leaving; one per request,
    shared by its waits (admission, first byte, a cascade's held tier, the relay).

    While a wait is *armed* (``arm``) the watcher cancels the waiting task when the client
    leaves; otherwise it only records it (``gone``), and the next wait ends at once.
    Single-threaded safety: the watcher cancels only a task that is armed at that moment,
    and the task disarms (in ``disarm``'s ``finally``) before its next await, so a
    cancellation never lands after the watched work is over.
    """

    def __init__(self, scope: Scope, receive: Receive):
        self.task: asyncio.Task | None = None  # the armed wait's task
        self.gone = False
        self.cancelled = False  # it cancelled the armed task (``absorb`` consumes that)
        tell = scope.get("extensions", {}).get(DISCONNECT_EXTENSION)
        if tell is not None:
            tell(self.left)
        else:
            asyncio.ensure_future(self._watch(receive))

    @classmethod
    def of(cls, scope: Scope, receive: Receive) -> _DisconnectWatch:
        """The request's watch, made at its first wait. Must only be asked for after the
        request body has been read."""
        watch = scope.get(WATCH_KEY)
        if watch is None:
            watch = scope[WATCH_KEY] = cls(scope, receive)
        return watch

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.left()  # (also once the response is complete: then nothing is armed)

    def left(self) -> None:
        """The client left: cancel the armed wait, if any."""
        self.gone = True
        if self.task is not None:
            self.cancelled = True
            self.task.cancel()

    def arm(self) -> asyncio.Task | None:
        """Cancel the current task if the client leaves, until ``disarm``; returns what was
        armed before (for ``disarm``)."""
        previous, self.task = self.task, asyncio.current_task()
        return previous

    def disarm(self, previous: asyncio.Task | None = None) -> None:
        self.task = previous

    def stop(self) -> None:
        """The response is over: no more waits. A watcher task is not cancelled: once the
        response is sent, ``receive`` answers ``http.disconnect`` (the ASGI spec's rule), so
        it ends by itself. A cancelled one ended in a CancelledError whose traceback held
        its frames, and through them the request's whole ASGI cycle, in a reference cycle:
        about 20 objects a request left for the garbage collector."""
        self.task = None

    def absorb(self) -> bool:
        """After a CancelledError: True (and the cancellation is consumed) when it was the
        client leaving."""
        if self.cancelled:
            self.cancelled = False
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            return True
        return False


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first (or has already), cancel it and raise
    ClientDisconnected. Must only be called after the request body has been read."""
    watch = _DisconnectWatch.of(request.scope, request.receive)
    if watch.gone:
        _close(work)
        raise ClientDisconnected
    previous = watch.arm()
    try:
        return await work
    except asyncio.CancelledError:
        if watch.absorb():
            raise ClientDisconnected from None
        raise
    finally:
        watch.disarm(previous)


def _close(work: Any) -> None:
    """Drop an awaitable that will not be awaited (a coroutine is closed, a future cancelled)."""
    if asyncio.iscoroutine(work):
        work.close()
    elif asyncio.isfuture(work):
        work.cancel()


class RelayResponse(Response):
    """Streams an async byte iterator; stops it as soon as the client disconnects.

    Unlike Starlette's StreamingResponse this always closes the iterator on every exit
    path, and then calls ``on_close()``: the iterator's own ``finally`` does not run when
    it never started (the client left before its answer began, or the first ``send``
    failed), so what must be released whatever happens (the upstream answer, the request's
    lease) is released there.

    ``ended``, asked after each chunk, says when the source has nothing more (an upstream
    answer read to its end): that chunk is then sent as the body's last, rather than
    followed by an empty one (one write to the client fewer: an answer that arrives whole
    leaves in one write after the headers). Nothing is held back to find that out.
    """

    def __init__(self, chunks: AsyncIterator[bytes], status_code: int, headers: dict[str, str],
                 on_disconnect: Callable[[], None] = lambda: None,
                 ended: Callable[[], bool] = lambda: False,
                 on_close: Callable[[], None] | None = None):
        self.chunks = chunks
        self.on_disconnect = on_disconnect
        self.ended = ended
        self.on_close = on_close
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = _DisconnectWatch.of(scope, receive)
        watch.arm()
        try:
            if watch.gone:  # the client left before its answer began
                self.on_disconnect()
                return
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            complete = False
            async for chunk in self.chunks:
                if complete:  # (the source said it had ended: nothing can follow)
                    logger.warning("a relayed stream went on after its end; %d bytes dropped",
                                   len(chunk))
                    continue
                complete = self.ended()
                await send({"type": "http.response.body", "body": chunk,
                            "more_body": not complete})
            if not complete:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            self.on_disconnect()
        except OSError:  # the client's socket went away under a send
            self.on_disconnect()
        finally:
            watch.stop()
            await self.aclose()

    async def aclose(self) -> None:
        """Close the source, then ``on_close()`` (once it is sent, or when it will not be:
        whether or not the source ever started)."""
        await self.chunks.aclose()  # type: ignore[attr-defined]
        if self.on_close is not None:
            self.on_close()
