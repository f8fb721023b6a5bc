"""Coarse timeouts for the proxy path: one timer for many deadlines."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class Deadlines:
    """Deadlines of one length, checked by one periodic sweep rather than a timer each.

    The router sets one on each request (its first byte, ``Exchange``) and on each wait for
    more of a worker's answer (the read timeout, ``sluice.router.upstream``): a timer of
    uvloop's costs about 8,000 instructions to start and stop, and ``asyncio.timeout``
    around one about 27,000, 4 % of the router's instructions a request (callgrind). Here
    a deadline is a dict entry, and one timer, running while any is pending, sweeps them
    every ``tick_s`` (``timeout_s / 10``, at most 1 s): a deadline fires up to ``tick_s``
    late.

    Args:
        timeout_s: seconds from ``add`` to the deadline.
        clock: monotonic seconds (the dispatcher's).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float]):
        self.timeout_s = timeout_s
        self.tick_s = min(1.0, timeout_s / 10)
        self.clock = clock
        self._pending: dict[object, tuple[float, Callable[[], None]]] = {}
        self._timer: asyncio.TimerHandle | None = None

    def add(self, key: object, expire: Callable[[], None], now: float) -> None:
        """Call ``expire()`` once ``timeout_s`` after ``now``, unless ``key`` is removed."""
        self._pending[key] = (now + self.timeout_s, expire)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._sweep)

    def remove(self, key: object) -> None:
        self._pending.pop(key, None)

    def _sweep(self) -> None:
        now = self.clock()
        due = [self._pending.pop(key)[1] for key, (deadline, _) in list(self._pending.items())
               if deadline <= now]
        self._timer = asyncio.get_running_loop().call_later(self.tick_s, self._sweep) \
            if self._pending else None
        for expire in due:
            expire()
