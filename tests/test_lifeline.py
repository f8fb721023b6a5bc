"""sluice.local.parent: a sluice up child stops when the supervisor's lifeline closes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from sluice.local.parent import LIFELINE_ENV, lifeline

CHILD = ("import sys, time; from sluice.local.parent import watch_parent, LIFELINE_ENV; "
         "import os; t = watch_parent(); print(t is not None, LIFELINE_ENV in os.environ, "
         "flush=True); time.sleep(60)")


def start(env_value: str, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL,
                            env={**os.environ, LIFELINE_ENV: env_value}, pass_fds=pass_fds)


def test_a_child_stops_itself_when_the_lifeline_closes():
    read, write = lifeline()
    child = start(str(read), pass_fds=(read,))
    os.close(read)
    try:
        # watching, and the variable is gone from its environment (its children lack it)
        assert child.stdout.readline().split() == ["True", "False"]
        assert child.poll() is None
        os.close(write)  # what the supervisor's death does
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_a_stale_or_foreign_descriptor_is_not_watched():
    for value in ("987", "0", "x", ""):  # not open here; /dev/null, not a pipe; not a number
        child = start(value)
        try:
            assert child.stdout.readline().split() == ["False", "False"], value
        finally:
            child.kill()
            child.wait()
