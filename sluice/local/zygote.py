"""Workers forked from a process that has already imported torch and Sluice (a zygote).

A fresh ``python -m sluice.cli worker`` spends most of its boot importing: Python, FastAPI,
torch, transformers and Sluice's command modules (~2.5 s of a ~4.4 s boot on this machine,
and CPU time taken from the workers already serving). ``sluice up`` starts its native-engine
workers instead from a fork server (the standard library's ``multiprocessing`` "forkserver"
context) that imported all of that once: a forked worker only loads its model and warms up
(``bench/boot.py`` measures both side by side). The technique is Android's zygote and the
fork server of ``multiprocessing`` itself.

The fork server imports modules and never runs a torch operation: a process that forks after
OpenMP started its thread pool hands its children a pool they cannot use. Each child then
takes the thread count its ``OMP_NUM_THREADS`` asks (``torch.set_num_threads``: the fork
server's OpenMP read the supervisor's environment when torch was imported).

A forked worker is a child of the fork server, not of the supervisor; it gets the
supervisor's lifeline all the same, and stops itself when the supervisor is gone
(``sluice.local.parent``).
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from pathlib import Path
from typing import IO

import setproctitle

from sluice.cli import COMMANDS
from sluice.local.parent import LIFELINE_ENV

# Imported by the fork server once; what a worker would import first thing.
PRELOAD = ["torch", "torch.utils.cpp_extension", "sluice.worker.engine.async_engine",
           *(module for module, _ in COMMANDS.values())]
CLI = ["-m", "sluice.cli"]


def forkable(argv: list[str]) -> bool:
    """True for a ``sluice.cli`` command line run by this interpreter (a native worker; a
    vLLM worker runs from another venv's Python and is started the usual way)."""
    return len(argv) > 3 and argv[0] == sys.executable and argv[1:3] == CLI


class Zygote:
    """Forks ``sluice.cli`` commands from a fork server that preloaded ``PRELOAD``.

    The fork server starts here and imports in the background; the first ``spawn`` waits
    for those imports (as long as a fresh process would take). It runs in the caller's
    process group, so it starts with SIGINT and SIGTERM ignored (a terminal's Ctrl-C and a
    group SIGTERM are the supervisor's to handle; ``multiprocessing`` ignores SIGINT there
    only after the imports); each child restores them. One that died anyway is started
    again by the next ``spawn``; its children run on, tracked by pid.
    """

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        _ensure_running()

    def spawn(self, argv: list[str], env: dict[str, str],
              lifeline: int | None = None) -> ForkedProcess:
        """Start ``argv`` (a ``forkable`` command line) with ``env`` as its whole environment
        and, when given, the read end of the supervisor's ``lifeline`` (``sluice.local.parent``).

        Returns a handle with the ``subprocess.Popen`` surface the supervisor uses: ``pid``,
        ``stdout`` (the child's stdout and stderr, binary), ``poll()``, ``wait(timeout)``,
        ``returncode`` (negative: killed by that signal).

        Raises:
            ValueError: ``argv`` is not forkable.
            OSError, EOFError: the fork server could not be started or reached, or died
                while answering.
        """
        if not forkable(argv):
            raise ValueError(f"not a sluice.cli command of this interpreter: {argv[:3]}")
        reader, writer = self._context.Pipe(duplex=False)
        line = None if lifeline is None else Connection(os.dup(lifeline), writable=False)
        process = self._context.Process(target=_child, args=(argv[3:], env, writer, line),
                                        name="sluice-worker", daemon=True)
        try:
            _ensure_running()
            process.start()
            stdout = os.fdopen(os.dup(reader.fileno()), "rb")
        finally:
            for end in (reader, writer, line):
                if end is not None:
                    end.close()
        return ForkedProcess(process, stdout)


def _ensure_running() -> None:
    """Start the fork server if it is not running, with SIGINT and SIGTERM ignored (the
    disposition survives its exec). Signal dispositions change only in the main thread;
    elsewhere the fork server starts with ours."""
    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                    signal.SIGTERM)}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ForkedProcess:
    """A forked ``sluice.cli`` command, seen through ``subprocess.Popen``'s surface.

    Its exit status comes from the fork server (its parent, which reaps it), but whether it
    runs is read from ``/proc`` (pid and start time): a fork server that died reports 255
    for children that run on. Once such a child is gone its status is unknown: 255.
    """

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout: IO[bytes]):
        self._process = process
        self.pid: int = process.pid
        self.stdout = stdout
        self._started = _start_time(self.pid)

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        if self._started is not None and _start_time(self.pid) == self._started:
            return None
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Raises ``subprocess.TimeoutExpired`` if it is still running after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.02)
        return code


def _start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/PID/stat``) while it runs;
    None once it is gone or a zombie, or without ``/proc`` (then the fork server's report
    alone tells)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, from field 3
    return None if fields[0] in ("Z", "X") else fields[19]


def _child(argv: list[str], env: dict[str, str], output: Connection,
           lifeline: Connection | None) -> None:
    """The forked process: a session of its own, output to the supervisor's pipe, the
    worker's environment, lifeline and thread count, then ``sluice.cli.main``."""
    os.setsid()  # its own process group: signalled as one, deaf to the terminal's Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the fork server ignores them
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    os.close(null)
    output.close()
    sys.stdout.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED's effect, read at startup
    sys.stderr.reconfigure(line_buffering=True)
    setproctitle.setproctitle(shlex.join([sys.executable, *CLI, *argv]))  # what ps shows
    os.environ.clear()
    os.environ.update(env)
    if lifeline is not None:
        os.environ[LIFELINE_ENV] = str(os.dup(lifeline.fileno()))
        lifeline.close()
    import torch

    torch.seed()  # a fork has the fork server's RNG state: unseeded samples of every worker
    # were the same (Python's random reseeds at fork; torch does not)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    from sluice.cli import main

    sys.exit(main(argv))
