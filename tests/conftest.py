"""Shared fixtures: the real default model, and real server processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluice.models import store

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The converted SmolLM2-135M-Instruct folder (fetched once into $SLUICE_HOME)."""
    return store.fetch(store.DEFAULT_MODEL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float) -> str | None:
    """Poll ``url``/health until 200; None then, else what went wrong: ``proc`` (anything
    with ``poll()`` and ``returncode``) exited, or ``timeout`` seconds passed."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        if time.monotonic() > deadline:
            return f"not healthy after {timeout:.0f} s"
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@asynccontextmanager
async def http_stub(answer: Callable[[str], tuple[int, Any]]) -> AsyncIterator[str]:
    """A real HTTP/1.1 server on 127.0.0.1, in the running event loop, for the endpoint
    poller's GETs: ``answer(path)`` gives each one's status and JSON body (None: empty;
    bytes: sent as they are). Yields its base URL."""

    handlers: set[asyncio.Task] = set()

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                status, obj = answer(head.split(b" ", 2)[1].decode())
                body = obj if isinstance(obj, bytes) else b"" if obj is None \
                    else json.dumps(obj).encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(reply, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        for task in handlers:  # (connections kept alive by the client under test)
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


@contextmanager
def serve(args: list[str], port: int, timeout: float = 120.0, log: Path | None = None,
          python: str = sys.executable):
    """Run ``python -m sluice.cli ARGS`` as a real process; yield its base URL once /health
    answers 200. A failed start raises with the tail of ``log``.

    The process is stopped with SIGTERM (then SIGKILL after 30 s) on exit.
    """
    out = open(log, "wb") if log else subprocess.DEVNULL
    proc = subprocess.Popen([python, "-m", "sluice.cli", *args], stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        problem = wait_healthy(url, proc, timeout)
        if problem:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:]) if log else ""
            raise RuntimeError(f"sluice {' '.join(args)} {problem}\n{tail}")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if log:
            out.close()


@pytest.fixture(scope="session")
def worker_url(model_path, tmp_path_factory) -> str:
    """One real `sluice worker` process serving SmolLM2 for the whole session."""
    port = free_port()
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with serve(["worker", "--model", str(model_path), "--served-model-name",
                store.DEFAULT_MODEL, "--port", str(port)], port, log=log) as url:
        yield url
