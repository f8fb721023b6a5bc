"""A ``sluice up`` child stops when its supervisor is gone.

The supervisor starts each child in a session of its own (so a terminal's Ctrl-C reaches the
supervisor alone, which then stops the children in order). A supervisor that is SIGKILLed
stops nothing, and its workers and router lived on, holding their ports. So the supervisor
holds the write end of a pipe, its lifeline, that no other process holds; each child gets
the read end (its descriptor number in ``SLUICE_LIFELINE_FD``), and a thread of the child
blocks reading it. Nothing is ever written: the read returns end-of-file the moment the
supervisor is gone, however it went, and the child SIGTERMs itself (a graceful stop). A
pipe, not the parent's pid, since a forked worker's parent is the zygote's fork server
(``sluice.local.zygote``), not the supervisor.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading

LIFELINE_ENV = "SLUICE_LIFELINE_FD"

logger = logging.getLogger(__name__)


def lifeline() -> tuple[int, int]:
    """A new lifeline: (read end for the children, write end the supervisor keeps open).
    Both are non-inheritable; pass the read end on explicitly (``pass_fds``)."""
    return os.pipe()


def watch_parent() -> threading.Thread | None:
    """Start the watch (a daemon thread) when ``SLUICE_LIFELINE_FD`` names a pipe; None
    otherwise. The variable is removed, so this process's own children do not inherit it."""
    value = os.environ.pop(LIFELINE_ENV, "")
    if not value.isdigit():
        return None
    fd = int(value)
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
    except OSError:  # a stale variable: no such descriptor here
        return None

    def watch() -> None:
        try:
            while os.read(fd, 1):  # nothing is written: b"" is end-of-file
                pass
        except OSError:
            return
        logger.warning("the supervisor is gone; stopping")
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
