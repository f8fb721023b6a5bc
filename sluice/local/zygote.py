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

import logging
import multiprocessing
import os
import shlex
import subprocess
import sys
from multiprocessing import forkserver
from multiprocessing.connection import Connection
from typing import IO

import setproctitle

from sluice.cli import COMMANDS
from sluice.local.parent import LIFELINE_ENV

logger = logging.getLogger(__name__)

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
    for those imports (as long as a fresh process would take). ``multiprocessing`` restarts
    a fork server that died.
    """

    def __init__(self) -> None:
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload(PRELOAD)
        forkserver.ensure_running()

    def spawn(self, argv: list[str], env: dict[str, str],
              lifeline: int | None = None) -> ForkedProcess:
        """Start ``argv`` (a ``forkable`` command line) with ``env`` as its whole environment
        and, when given, the read end of the supervisor's ``lifeline`` (``sluice.local.parent``).

        Returns a handle with the ``subprocess.Popen`` surface the supervisor uses: ``pid``,
        ``stdout`` (the child's stdout and stderr, binary), ``poll()``, ``wait(timeout)``,
        ``returncode`` (negative: killed by that signal).

        Raises:
            ValueError: ``argv`` is not forkable.
            OSError: the fork server could not be started or reached.
        """
        if not forkable(argv):
            raise ValueError(f"not a sluice.cli command of this interpreter: {argv[:3]}")
        reader, writer = self._context.Pipe(duplex=False)
        line = None if lifeline is None else Connection(os.dup(lifeline), writable=False)
        process = self._context.Process(target=_child, args=(argv[3:], env, writer, line),
                                        name="sluice-worker", daemon=True)
        try:
            process.start()
        finally:
            writer.close()
            if line is not None:
                line.close()
        stdout = os.fdopen(os.dup(reader.fileno()), "rb")
        reader.close()
        return ForkedProcess(process, stdout)


class ForkedProcess:
    """A forked ``sluice.cli`` command, seen through ``subprocess.Popen``'s surface."""

    def __init__(self, process: multiprocessing.process.BaseProcess, stdout: IO[bytes]):
        self._process = process
        self.pid: int = process.pid
        self.stdout = stdout

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """Raises ``subprocess.TimeoutExpired`` if it is still running after ``timeout`` s."""
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self._process.exitcode


def _child(argv: list[str], env: dict[str, str], output: Connection,
           lifeline: Connection | None) -> None:
    """The forked process: a session of its own, output to the supervisor's pipe, the
    worker's environment, lifeline and thread count, then ``sluice.cli.main``."""
    os.setsid()  # its own process group: signalled as one, deaf to the terminal's Ctrl-C
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
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    from sluice.cli import main

    sys.exit(main(argv))
