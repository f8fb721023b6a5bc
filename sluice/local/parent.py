"""A ``sluice up`` child stops when its supervisor is gone.

The supervisor starts each child in a session of its own (so a terminal's Ctrl-C reaches the
supervisor alone, which then stops the children in order) and sets ``SLUICE_PARENT_PID``.
A supervisor that is SIGKILLed stops nothing, and its workers and router lived on, holding
their ports; so a child with that variable watches its parent and SIGTERMs itself (a
graceful stop) once the parent is no longer the process that started it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

PARENT_ENV = "SLUICE_PARENT_PID"
POLL_S = 1.0

logger = logging.getLogger(__name__)


def watch_parent(poll_s: float = POLL_S) -> threading.Thread | None:
    """Start the watch (a daemon thread) when ``SLUICE_PARENT_PID`` is set; None otherwise."""
    value = os.environ.get(PARENT_ENV)
    if not value or not value.isdigit():
        return None
    parent = int(value)

    def watch() -> None:
        stopped = threading.Event()
        while not stopped.wait(poll_s):
            if os.getppid() != parent:
                logger.warning("the supervisor (pid %d) is gone; stopping", parent)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
