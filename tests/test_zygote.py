"""sluice.local.zygote: workers forked from a fork server that preloaded torch and Sluice,
with real worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import free_port, wait_healthy
from sluice.local.zygote import Zygote, forkable

slow = pytest.mark.slow  # forks model-loading workers
CLI = [sys.executable, "-m", "sluice.cli"]


def test_only_sluice_commands_of_this_interpreter_are_forkable():
    assert forkable([*CLI, "worker", "--port", "1"])
    assert forkable([*CLI, "router"])
    assert not forkable(["/other/venv/bin/python", "-m", "sluice.cli", "worker"])  # vLLM's
    assert not forkable([sys.executable, "-m", "pytest"])
    assert not forkable([sys.executable, "-c", "print(1)"])
    assert not forkable(CLI)  # no command
    with pytest.raises(ValueError, match="not a sluice.cli command"):
        Zygote.spawn(object.__new__(Zygote), [sys.executable, "-c", "1"], {})


@pytest.fixture(scope="module")
def zygote():
    return Zygote()


class Output:
    """A forked child's output, read on a thread (as the supervisor does)."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc) -> None:
        for line in iter(proc.stdout.readline, b""):
            self.lines.append(line.decode())
        proc.stdout.close()

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)


@slow
@pytest.mark.parametrize("threads", [1, 2])
def test_a_forked_worker_serves_in_its_own_session_with_its_threads(zygote, model_path,
                                                                    threads):
    port = free_port()
    argv = [*CLI, "--log-level", "INFO", "worker", "--model", str(model_path), "--port",
            str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = zygote.spawn(argv, env)
    out = Output(proc)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", proc, 120.0) is None
        assert os.getsid(proc.pid) == proc.pid  # a session (and process group) of its own
        assert " ".join(psutil.Process(proc.pid).cmdline()).split() == argv  # what ps shows
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM  # uvicorn re-raises it after its shutdown
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out.text()
    assert f"cpu, {threads} thread(s)" in text, text
    assert '"POST /v1/completions HTTP/1.1" 200' in text  # stdout and stderr both come back


@slow
def test_forked_workers_do_not_share_a_random_state(zygote, model_path):
    """Found by a fresh user: two workers of one sluice up gave byte-identical unseeded
    samples (each fork started from the fork server's torch RNG state)."""
    ports, procs = [free_port(), free_port()], []
    try:
        for port in ports:
            procs.append(zygote.spawn([*CLI, "worker", "--model", str(model_path), "--port",
                                       str(port)], {**os.environ, "OMP_NUM_THREADS": "1"}))
        texts = []
        for port, proc in zip(ports, procs):
            assert wait_healthy(f"http://127.0.0.1:{port}", proc, 120.0) is None
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0,
                "ignore_eos": True})
            texts.append(r.json()["choices"][0]["text"])
        assert texts[0] != texts[1], texts
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


@slow
def test_a_forked_command_that_fails_reports_its_exit_code_and_error(zygote, tmp_path):
    proc = zygote.spawn([*CLI, "worker", "--model", str(tmp_path / "missing")],
                        dict(os.environ))
    out = Output(proc)
    assert proc.wait(60) == 1
    assert proc.returncode == 1
    assert f"sluice worker: {tmp_path / 'missing'}" in out.text()


@slow
def test_a_fork_server_that_dies_leaves_its_children_tracked_and_is_replaced(zygote, model_path,
                                                                              tmp_path):
    """Killing the fork server (a fault sluice up cannot prevent) must not make its running
    children look dead (multiprocessing then reports 255 for each): they are tracked by pid
    and start time. The fork server shrugs off SIGTERM (a group signal is the supervisor's),
    and the next spawn starts a new one."""
    port = free_port()
    proc = zygote.spawn([*CLI, "worker", "--model", str(model_path), "--port", str(port)],
                        {**os.environ, "OMP_NUM_THREADS": "1"})
    out = Output(proc)
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", proc, 120.0) is None
        server = psutil.Process(psutil.Process(proc.pid).ppid())
        assert "forkserver" in " ".join(server.cmdline())
        os.kill(server.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert server.is_running() and server.status() != psutil.STATUS_ZOMBIE
        server.kill()  # not reaped here: multiprocessing reaps it when it starts a new one
        deadline = time.monotonic() + 10
        while server.status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        assert proc.poll() is None and proc.returncode is None  # it serves on
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 255  # gone; its status died with the fork server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out.text()
    again = zygote.spawn([*CLI, "worker", "--model", str(tmp_path / "missing")],
                         dict(os.environ))
    Output(again)
    assert again.wait(60) == 1
