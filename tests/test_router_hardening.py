"""Router hardening (issue 10, the router's side): request-body limit, bounded routing headers,
API-key tenants with priority ceilings and RPM/TPM limits, ejection of failing workers with
their unanswered requests sent elsewhere, and keep-alive aligned with the workers'.

The tenant logic is tested first without servers (an injected clock, a key file on disk); the
rest with a real router process in front of scripted fake workers on 127.0.0.1: a fake is
used for the faults a real worker cannot be made to show on demand (a /health that hangs or
reports a dead engine, a connection closed just as a request is written on it, a stream that
stalls), and for exact usage numbers.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
import yaml

from conftest import ROOT, free_port
from sluice.api import metrics as names
from sluice.router.app import KEEPALIVE_S, MAX_BODY_BYTES, RouterConfig
from sluice.router.dispatch import BadRoutingHeader, DispatchSettings
from sluice.router.limits import (RateLimited, TenantLimits, TokenBucket, estimate_tokens,
                                  usage_in)
from sluice.router.tenants import KeyFileError, KeyRing, Tenant, Unauthorized, parse_key_file
from test_chart import (CHART, KUBE_VERSIONS, NAMESPACE, RELEASE, container, find, helm, one,
                        parse_cli, render, run_helm)
from test_router import MODEL, health, metric, ready_workers, serve_router, wait_until
from test_router_dispatch import BODY, fleet
from test_router_resilience import FakeWorker, complete, start_worker

__all__ = ["helm"]  # test_chart's session fixture (helm), used by the chart tests below
pytestmark = pytest.mark.filterwarnings(  # kubernetes-validate 1.28 on a newer jsonschema
    "ignore:jsonschema.RefResolver is deprecated:DeprecationWarning",
    "ignore:The metaschema specified by \\$schema was not found:DeprecationWarning")

KEY_A, KEY_B, KEY_C, KEY_D = ("sk-team-a-0123456789", "sk-team-b-0123456789",
                              "sk-team-c-0123456789", "sk-team-d-0123456789")


# ------------------------------------------------------------------ pure: key file, limits

def key_file(path: Path, tenants: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def test_key_file_maps_keys_and_digests_to_tenants():
    sha = hashlib.sha256(KEY_B.encode()).hexdigest()
    tenants, keys = parse_key_file({"tenants": [
        {"name": "team-a", "keys": [KEY_A], "maxPriority": -10, "rpm": 60, "tpm": 1000},
        {"name": "team-b", "keySha256": [sha.upper()]}]})
    assert tenants == {"team-a": Tenant("team-a", -10, 60.0, 1000.0), "team-b": Tenant("team-b")}
    assert keys == {hashlib.sha256(KEY_A.encode()).digest(): "team-a",
                    bytes.fromhex(sha): "team-b"}


@pytest.mark.parametrize("data, message", [
    ([], "a mapping with a `tenants` list"),
    ({"tenants": [{"name": "a b", "keys": ["k"]}]}, r"tenants\[0\]: name must match"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}]}, "twice"),
    ({"tenants": [{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}]},
     "a key of b is also a's"),
    ({"tenants": [{"name": "a"}]}, "has no keys"),
    ({"tenants": [{"name": "a", "keys": ["k"], "rpm": 0}]}, "rpm must be a number > 0"),
    ({"tenants": [{"name": "a", "keys": ["k"], "tpm": "many"}]}, "tpm must be a number > 0"),
    ({"tenants": [{"name": "a", "keys": ["k"], "maxPriority": -2**31}]}, "maxPriority"),
    ({"tenants": [{"name": "a", "keys": ["k"], "maxPriorty": 1}]}, "unknown field.*maxPriorty"),
    ({"tenants": [{"name": "a", "keySha256": ["abc"]}]}, "64 hex digits"),
    ({"tenants": [{"name": "a", "keys": [" k"]}]}, "empty or has spaces"),
])
def test_malformed_key_files_name_the_entry(data, message):
    with pytest.raises(KeyFileError, match=message):
        parse_key_file(data)


def test_bearer_keys_and_401_reasons(tmp_path):
    ring = KeyRing(str(key_file(tmp_path / "keys.yaml", [{"name": "a", "keys": [KEY_A]}])), 0.0)
    assert ring.tenant_for(f"Bearer {KEY_A}").name == "a"
    assert ring.tenant_for(f"bearer  {KEY_A} ").name == "a"
    for header, code in ((None, None), ("", None), ("Bearer nope", "invalid_api_key"),
                         (f"Basic {KEY_A}", "invalid_api_key"), ("Bearer", "invalid_api_key")):
        with pytest.raises(Unauthorized) as info:
            ring.tenant_for(header)
        assert info.value.code == code


def test_key_file_reloads_when_it_changes_and_keeps_the_last_good_one(tmp_path):
    path = key_file(tmp_path / "keys.yaml", [{"name": "a", "keys": [KEY_A]}])
    ring = KeyRing(str(path), now=100.0, check_interval=1.0)
    replacement = key_file(tmp_path / "new.yaml", [{"name": "b", "keys": [KEY_B]}])
    os.replace(replacement, path)
    assert not ring.refresh(100.5)  # not due yet
    assert ring.tenant_for(f"Bearer {KEY_A}").name == "a"
    assert ring.refresh(101.0) and ring.reloads == 1
    assert ring.tenant_for(f"Bearer {KEY_B}").name == "b"
    with pytest.raises(Unauthorized):
        ring.tenant_for(f"Bearer {KEY_A}")
    assert not ring.refresh(102.0)  # unchanged
    path.write_text("tenants: [{name: c}]  # no keys")  # a bad edit
    assert not ring.refresh(103.0)
    assert ring.tenant_for(f"Bearer {KEY_B}").name == "b"
    path.write_text("{not yaml")
    assert not ring.refresh(104.0) and ring.reloads == 1
    path.unlink()
    assert not ring.refresh(105.0)  # gone: the last good set stays
    assert ring.tenant_for(f"Bearer {KEY_B}").name == "b"
    with pytest.raises(OSError):
        KeyRing(str(path), 0.0)  # but a router does not start without it


def secret_volume(root: Path, version: int, tenants: list[dict]) -> Path:
    """What the kubelet does for a Secret volume: the data in a timestamped folder, a
    ``..data`` symlink to it swapped atomically, and ``keys.yaml -> ..data/keys.yaml``."""
    data = root / f"..v{version}"
    data.mkdir()
    key_file(data / "keys.yaml", tenants)
    link = root / "..data_tmp"
    link.symlink_to(data.name)
    os.replace(link, root / "..data")
    if not (root / "keys.yaml").is_symlink():
        (root / "keys.yaml").symlink_to("..data/keys.yaml")
    return root / "keys.yaml"


def test_a_kubernetes_secret_update_is_seen(tmp_path):
    path = secret_volume(tmp_path, 1, [{"name": "a", "keys": [KEY_A]}])
    ring = KeyRing(str(path), 0.0)
    secret_volume(tmp_path, 2, [{"name": "a", "keys": [KEY_A, KEY_B]}])
    assert ring.refresh(1.0)
    assert ring.tenant_for(f"Bearer {KEY_B}").name == "a"


def test_token_bucket_refills_per_minute():
    bucket = TokenBucket(60, now=0.0)  # 1 a second, a minute's worth at most
    assert bucket.wait_s(60, 0.0) == 0
    bucket.take(60, 0.0)
    assert bucket.wait_s(1, 0.0) == pytest.approx(1.0)
    assert bucket.wait_s(1, 0.5) == pytest.approx(0.5)
    assert bucket.wait_s(100, 0.5) == pytest.approx(59.5)  # at most the capacity is awaited
    bucket.give(1000, 1.0)
    assert bucket.level == 60
    bucket.take(70, 1.0)  # a correction upwards goes below zero
    assert bucket.wait_s(1, 1.0) == pytest.approx(11.0)


def test_rpm_and_tpm_refuse_with_retry_after_and_corrections_follow_the_usage():
    limits = TenantLimits()
    tenant = Tenant("t", rpm=3, tpm=100)
    limits.update({"t": tenant}, 0.0)
    first = limits.charge(tenant, 80, 0.0, prompt_tokens=5)
    with pytest.raises(RateLimited) as info:
        limits.charge(tenant, 30, 0.0)
    assert (info.value.limit, info.value.retry_after_s) == ("tpm", 6)  # 10 short, 100/min
    first.settle(200, 20, 0.0)  # the worker used 20: 60 back
    second = limits.charge(tenant, 30, 0.0)
    second.settle(502, None, 0.0, served=False)  # no worker answered: refunded
    with pytest.raises(RateLimited) as info:  # at most a minute's worth is awaited: 100
        limits.charge(tenant, 10**9, 0.0)
    assert (info.value.limit, info.value.retry_after_s) == ("tpm", 12)  # 20 short
    assert "limit 100, this request needs 1e+09 (it waits for a full budget)." in str(info.value)
    big = limits.charge(tenant, 10**9, 12.0)
    assert big.tokens == 100
    with pytest.raises(RateLimited) as info:
        limits.charge(tenant, 1, 12.0)
    assert (info.value.limit, info.value.retry_after_s) == ("rpm", 8)  # 0.6 left, 3/min
    assert "limit 3, this request needs 1. Please try again in 8s." in str(info.value)
    big.settle(200, None, 30.0)  # usage unknown: the charge stands
    big.settle(200, 5, 30.0)  # settled once
    text = {(m.name, tuple(s.labels.values())): s.value
            for m in limits.collect() for s in m.samples}
    assert text[("sluice_router_tenant_requests", ("t", "200"))] == 2
    assert text[("sluice_router_tenant_requests", ("t", "502"))] == 1
    assert text[("sluice_router_tenant_requests", ("t", "429"))] == 3
    assert text[("sluice_router_tenant_rate_limited", ("t", "tpm"))] == 2
    assert text[("sluice_router_tenant_rate_limited", ("t", "rpm"))] == 1
    assert text[("sluice_router_tenant_tokens", ("t",))] == 20 + 100
    limits.update({}, 31.0)  # the tenant left the key file: its series go
    assert all(not m.samples for m in limits.collect())


def test_token_estimates():
    assert estimate_tokens({"prompt": "x" * 400, "max_tokens": 50}, 2048) == (150, 100)
    assert estimate_tokens({"prompt": ["x" * 40, "y" * 80], "max_tokens": 5, "n": 2},
                           None) == (30 + 5 * 2 * 2, 30)
    assert estimate_tokens({"prompt": [1, 2, 3], "max_completion_tokens": 7}, None) == (10, 3)
    assert estimate_tokens({"prompt": [[1, 2], [3]], "max_tokens": 1}, None) == (5, 3)
    assert estimate_tokens({"prompt": "x" * 40}, 1000) == (1000, 10)  # the rest of the context
    assert estimate_tokens({"messages": [{"role": "user", "content": "x" * 40}],
                            "max_tokens": 6}, None) == (10 + 4 + 6, 14)
    assert estimate_tokens({"prompt": "hi", "max_tokens": True, "n": -1}, None)[0] == 4096
    assert usage_in(b'{"choices":[],"usage":{"prompt_tokens":3,"total_tokens": 12}}') == 12
    assert usage_in(b'data: {"choices":[{"text":"total_tokens"}]}\n\n') is None


# ------------------------------------------------------------------ pure: routing headers

@pytest.mark.parametrize("headers, body, param, status", [
    ({"x-slo-ttft-ms": "1e12"}, {}, "x-slo-ttft-ms", 400),
    ({"x-slo-itl-ms": "60001"}, {}, "x-slo-itl-ms", 400),
    ({"x-slo-ttft-ms": "-1"}, {}, "x-slo-ttft-ms", 400),
    ({"x-priority": "-2147483648"}, {}, "x-priority", 400),
    ({"x-priority": "1001"}, {}, "x-priority", 400),
    ({"x-priority": "1.5"}, {}, "x-priority", 400),
    ({"x-priority": "1_000"}, {}, "x-priority", 400),  # int() would take both
    ({"x-priority": "\u0663"}, {}, "x-priority", 400),  # (ARABIC-INDIC DIGIT THREE)
    ({}, {"priority": float("inf")}, "priority", 400),  # what JSON's 1e400 parses to
    ({}, {"priority": 2.5}, "priority", 400),
    ({}, {"priority": [1]}, "priority", 400),
    ({"x-priority": "-1"}, {}, "x-priority", 403),
    ({}, {"priority": -1000}, "priority", 403),
])
def test_routing_headers_are_bounded(headers, body, param, status):
    _, d = fleet()
    with pytest.raises(BadRoutingHeader) as info:
        d.routing_request({**BODY, **body}, headers, 0)
    assert (info.value.param, info.value.status) == (param, status)


def test_priority_ceilings():
    _, d = fleet()
    assert d.routing_request(BODY, {"x-slo-ttft-ms": "60000"}, 0).ttft_slo_s == 60.0
    assert d.routing_request({**BODY, "priority": 7.0}, {}, 0).priority == 7
    assert d.routing_request(BODY, {"x-priority": "-10"}, 0, ceiling=-10).priority == -10
    assert d.routing_request(BODY, {}, 0, ceiling=-10).priority == 0  # asks for nothing
    assert d.routing_request(BODY, {}, 0, ceiling=5).priority == 5  # a tenant held back
    with pytest.raises(BadRoutingHeader):
        d.routing_request(BODY, {"x-priority": "4"}, 0, ceiling=5)
    _, strict = fleet(public_priority=10, max_slo_ms=500)
    assert strict.routing_request(BODY, {}, 0).priority == 10
    with pytest.raises(BadRoutingHeader, match="at most 500"):
        strict.routing_request(BODY, {"x-slo-ttft-ms": "501"}, 0)
    with pytest.raises(ValueError):
        DispatchSettings(public_priority=-5000)


# ------------------------------------------------------------------ pure: keep-alive

def worker_keepalive_s() -> float:
    """The idle keep-alive of `sluice worker` (its uvicorn.Config call, else uvicorn's
    default)."""
    tree = ast.parse((ROOT / "sluice" / "worker" / "server.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "Config":
            for keyword in node.keywords:
                if keyword.arg == "timeout_keep_alive":
                    return float(ast.literal_eval(keyword.value))
    return float(uvicorn.Config(app=None).timeout_keep_alive)


def test_the_routers_idle_keepalive_is_below_the_workers():
    assert RouterConfig().keepalive_timeout == KEEPALIVE_S < worker_keepalive_s()
    assert MAX_BODY_BYTES <= 16 * 1024 * 1024


# ------------------------------------------------------------------ fake workers

class Worker(FakeWorker):
    """``FakeWorker`` plus: the headers of each POST (``seen``); a ``/health`` that hangs
    (``health = "hang"``) or answers ``health_body``; a plain JSON answer with ``usage``
    for ``stream: false``, and a usage chunk for ``include_usage``; ``stale``: a connection's
    second request is closed unanswered (the keep-alive running out as it was written);
    prompt ``stall``: one token, then nothing; ``generating``: each /metrics scrape shows
    more output tokens (a busy worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, str]] = []
        self.generating = False
        self.generated = 0
        self.health_body = '{"status": "ok"}'
        self.stale = False
        self.usage = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
                length = int(headers.get("content-length", 0))
                body = json.loads(await reader.readexactly(length)) if length else {}
                if method == "GET":
                    await self._get(path, writer)
                    continue
                self.posts += 1
                self.seen.append(headers)
                served += 1
                if self.stale and served > 1:
                    return  # closed (finally) with the request unanswered
                prompt = self.override or str(body.get("prompt", ""))
                if prompt == "hang":
                    await asyncio.sleep(3600)
                if prompt == "die":
                    writer.transport.abort()
                    return
                delay = float(prompt.split(":")[1]) if prompt.startswith("slow:") else 0.0
                if body.get("stream") is not True:
                    await self._json(writer, delay)
                else:
                    await self._events(writer, delay, prompt == "stall",
                                       (body.get("stream_options") or {}).get("include_usage"))
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def _get(self, path: str, writer: asyncio.StreamWriter) -> None:
        if path == "/health" and self.health == "hang":
            await asyncio.sleep(3600)
        if path == "/health":
            body, status = self.health_body, self.health
        elif path == "/v1/models":
            body, status = json.dumps({"object": "list", "data": [
                {"id": MODEL, "object": "model", "max_model_len": 2048}]}), 200
        elif path == "/metrics" and self.generating:
            self.generated += 5
            body, status = f"{names.GENERATION_TOKENS} {self.generated}.0\n", 200
        else:
            body, status = "", 200
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()

    async def _json(self, writer: asyncio.StreamWriter, delay: float) -> None:
        await asyncio.sleep(delay)
        body = json.dumps({"object": "text_completion", "model": MODEL,
                           "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                           "usage": self.usage}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()

    async def _events(self, writer: asyncio.StreamWriter, delay: float, stall: bool,
                      include_usage: bool) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(delay)
        events = [b'data: {"choices":[{"text":"hi","index":0}]}\n\n']
        if include_usage:
            events.append(b'data: {"choices":[],"usage":%s}\n\n' % json.dumps(self.usage).encode())
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            if stall:
                await asyncio.sleep(3600)
        event = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
        await writer.drain()


@contextmanager
def workers(n: int):
    fakes = sorted((Worker() for _ in range(n)), key=lambda w: w.url)  # the policies' order
    for w in fakes:
        w.__enter__()
    try:
        yield fakes
    finally:
        for w in fakes:
            w.__exit__()


@contextmanager
def router(fakes: list[Worker], *extra: str, ready: int | None = None):
    with serve_router([w.url for w in fakes], free_port(), *extra) as url:
        expected = len(fakes) if ready is None else ready
        assert wait_until(lambda: len(ready_workers(url)) == expected, 10)
        yield url


def samples(url: str, name: str) -> dict[str, float]:
    """``name``'s samples in ``url``'s /metrics, by their label text."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {labels: float(value) for labels, value in
            re.findall(rf"^{re.escape(name)}(\{{[^}}]*\}}|) (\S+)$", text, re.M)}


def error(status: int, message: str, type_: str = "invalid_request_error",
          param: str | None = None, code: str | None = None) -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": type_, "param": param, "code": code}}


def answer(response: httpx.Response) -> tuple[int, dict]:
    assert response.headers["content-type"] == "application/json", response.text
    return response.status_code, response.json()


# ------------------------------------------------------------------ sizes (item 3)

def test_a_body_over_the_limit_is_413_and_is_refused_while_it_is_read():
    with workers(1) as (w,), router([w], "--max-body-bytes", "1000") as url:
        too_large = error(413, "the request body is larger than 1000 bytes (the router's "
                          "--max-body-bytes)", code="request_too_large")
        r = httpx.post(f"{url}/v1/completions", timeout=10,
                       content=json.dumps({"model": MODEL, "prompt": "x" * 1000}))
        assert answer(r) == too_large
        assert r.headers["connection"] == "close"
        fits = {"model": MODEL, "prompt": "x" * 900, "max_tokens": 1}
        assert httpx.post(f"{url}/v1/completions", json=fits, timeout=10).status_code == 200
        # chunked, no Content-Length: the answer comes after 1,200 bytes, before the body ends
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                      b"content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
            chunk = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * 1200
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))  # ... and never the rest
            received = b""
            while b"\r\n\r\n" not in received:
                received += s.recv(65536)
            head, _, rest = received.partition(b"\r\n\r\n")
            length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
            while len(rest) < length:
                rest += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413 ")
        assert json.loads(rest) == too_large[1]
        assert w.posts == 1  # only the one that fit


# ------------------------------------------------------------------ routing headers (item 4)

def test_routing_headers_out_of_bounds_are_400s_naming_them():
    with workers(1) as (w,), router([w], "--max-slo-ms", "5000") as url:
        def send(headers=None, content=None):
            return httpx.post(f"{url}/v1/completions", headers=headers, timeout=10,
                              content=content or json.dumps({"model": MODEL, "prompt": "hi"}))

        slo = "x-slo-ttft-ms must be > 0 and at most 5000 (the router's --max-slo-ms)"
        assert answer(send({"x-slo-ttft-ms": "1e12"})) == error(400, slo, param="x-slo-ttft-ms")
        assert answer(send({"x-slo-ttft-ms": "5001"})) == error(400, slo, param="x-slo-ttft-ms")
        priority = "x-priority must be an integer from -1000 to 1000"
        assert answer(send({"x-priority": "-2147483648"})) == error(400, priority,
                                                                     param="x-priority")
        body = '{"model": "%s", "prompt": "hi", "priority": 1e400}' % MODEL
        assert answer(send(content=body)) == error(
            400, "priority must be an integer from -1000 to 1000", param="priority")
        assert answer(send({"x-priority": "-5"})) == error(
            403, "x-priority -5 is more urgent than this client may ask for (at most 0; lower "
            "is more urgent): use an API key whose tenant allows it", "permission_error",
            "x-priority", "priority_not_allowed")
        assert send({"x-slo-ttft-ms": "5000", "x-priority": "3"}).status_code == 200
        assert w.posts == 1


# ------------------------------------------------------------------ tenants (item 5)

@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A router with API keys in front of one fake worker: team-a may use priority -10,
    team-b has 2 RPM, team-c 60 TPM, team-d nothing special."""
    path = key_file(tmp_path_factory.mktemp("keys") / "keys.yaml", [
        {"name": "team-a", "keys": [KEY_A], "maxPriority": -10},
        {"name": "team-b", "keySha256": [hashlib.sha256(KEY_B.encode()).hexdigest()], "rpm": 2},
        {"name": "team-c", "keys": [KEY_C], "tpm": 60},
        {"name": "team-d", "keys": [KEY_D]}])
    with workers(1) as (w,), router([w], "--api-keys", str(path)) as url:
        yield url, w


def post(url: str, key: str | None, body: dict | None = None, **headers: str) -> httpx.Response:
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                      json=body or {"model": MODEL, "prompt": "hi", "max_tokens": 1})


def test_v1_routes_need_a_key_and_probes_do_not(keyed):
    url, w = keyed
    before = w.posts
    missing = error(401, "You didn't provide an API key. You need to provide your API key in an "
                    "Authorization header using Bearer auth (i.e. Authorization: Bearer "
                    "YOUR_KEY).")
    wrong = error(401, "Incorrect API key provided.", code="invalid_api_key")
    r = post(url, None)
    assert answer(r) == missing and r.headers["www-authenticate"] == "Bearer"
    assert answer(post(url, "sk-nope")) == wrong
    assert answer(httpx.post(f"{url}/v1/chat/completions", timeout=10,
                             headers={"authorization": f"Basic {KEY_A}"},
                             json={"model": MODEL, "messages": []})) == wrong
    assert answer(httpx.get(f"{url}/v1/models", timeout=10)) == missing
    models = httpx.get(f"{url}/v1/models", timeout=10,
                       headers={"authorization": f"Bearer {KEY_D}"})
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    for probe in ("/health", "/livez", "/metrics", "/autoscale/demand"):
        assert httpx.get(f"{url}{probe}", timeout=10).status_code == 200, probe
    assert w.posts == before  # nothing unauthenticated reached the worker
    r = post(url, KEY_D)
    assert r.status_code == 200 and w.posts == before + 1
    assert "authorization" not in w.seen[-1]  # the router's key stays at the router
    counted = samples(url, names.ROUTER_TENANT_REQUESTS)
    assert counted['{status="200",tenant="team-d"}'] == 1


def test_a_tenant_over_its_rpm_gets_429_with_retry_after(keyed):
    url, _ = keyed
    assert [post(url, KEY_B).status_code for _ in range(2)] == [200, 200]
    r = post(url, KEY_B)
    status, body = answer(r)
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert body["error"]["message"].startswith(
        "Rate limit reached for tenant team-b on requests per minute (RPM): limit 2,")
    assert 1 <= int(r.headers["retry-after"]) <= 30  # one request refills in 30 s
    assert post(url, KEY_D).status_code == 200  # other tenants are not affected
    assert samples(url, names.ROUTER_TENANT_RATE_LIMITED) == {
        '{limit="rpm",tenant="team-b"}': 1.0}
    counted = samples(url, names.ROUTER_TENANT_REQUESTS)
    assert (counted['{status="200",tenant="team-b"}'],
            counted['{status="429",tenant="team-b"}']) == (2, 1)


def test_tpm_is_charged_at_admission_and_corrected_to_the_usage(keyed):
    """60 TPM: max_tokens 30 is charged ~30 at admission; the worker reports 10 used, so a
    second and a third request of the same size fit (without the correction the second would
    not), and the tenant's token counter holds exactly what was used."""
    url, w = keyed
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 30}
    assert post(url, KEY_C, body).status_code == 200  # plain: usage in the body
    assert post(url, KEY_C, {**body, "stream": True,  # streamed with include_usage
                             "stream_options": {"include_usage": True}}).status_code == 200
    r = post(url, KEY_C, {**body, "stream": True})  # no usage: prompt + one token an event
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    r = post(url, KEY_C, {**body, "max_tokens": 59})
    status, answered = answer(r)
    assert status == 429 and answered["error"]["message"].startswith(
        "Rate limit reached for tenant team-c on tokens per minute (TPM): limit 60,")
    assert int(r.headers["retry-after"]) >= 1
    assert samples(url, names.ROUTER_TENANT_TOKENS)['{tenant="team-c"}'] == 10 + 10 + 1.5
    assert samples(url, names.ROUTER_TENANT_RATE_LIMITED)['{limit="tpm",tenant="team-c"}'] == 1


def test_priorities_above_the_public_level_need_a_tenant_allowed_them(keyed):
    url, _ = keyed
    assert post(url, KEY_A, **{"x-priority": "-10"}).status_code == 200
    assert post(url, KEY_A, {"model": MODEL, "prompt": "hi", "priority": -3}).status_code == 200
    r = post(url, KEY_A, **{"x-priority": "-11"})
    assert answer(r) == error(403, "x-priority -11 is more urgent than this client may ask for "
                              "(at most -10; lower is more urgent): use an API key whose "
                              "tenant allows it", "permission_error", "x-priority",
                              "priority_not_allowed")
    r = post(url, KEY_D, {"model": MODEL, "prompt": "hi", "priority": -1})
    assert answer(r)[0] == 403 and r.json()["error"]["param"] == "priority"
    assert post(url, KEY_D, **{"x-priority": "5"}).status_code == 200  # less urgent: free


def test_a_changed_key_file_is_used_without_a_restart(tmp_path):
    """The key file as a Kubernetes Secret volume (a ``..data`` symlink swapped): a new key
    works and a removed one gets 401, on the same router process."""
    path = secret_volume(tmp_path, 1, [{"name": "team-a", "keys": [KEY_A]}])
    with workers(1) as (w,), router([w], "--api-keys", str(path)) as url:
        assert post(url, KEY_A).status_code == 200
        assert post(url, KEY_B).status_code == 401
        secret_volume(tmp_path, 2, [{"name": "team-b", "keys": [KEY_B]}])
        assert wait_until(lambda: post(url, KEY_B).status_code == 200, 10, period=0.2)
        assert post(url, KEY_A).status_code == 401


def test_a_key_file_that_is_not_text_is_a_key_file_error(tmp_path):
    """Found by a break-it pass: a binary --api-keys file died in a UnicodeDecodeError."""
    path = tmp_path / "keys.bin"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(KeyFileError, match="not UTF-8 text"):
        KeyRing(str(path), 0.0)


def test_a_router_with_a_bad_key_file_does_not_start(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("tenants: [{name: a, keys: [k], rpm: -1}]")
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "router", "--api-keys", str(path),
                           "--port", str(free_port())], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 2
    assert "tenants[0]: rpm must be a number > 0" in done.stderr


# ------------------------------------------------------------------ ejection (item 6)

@contextmanager
def one_ready_then_two(*extra: str):
    """Two fakes behind a router, the second loading at first (so the first gets the
    request); ``go()`` makes the second ready and waits until the router sees it."""
    with workers(2) as (a, b):
        b.health, b.health_body = 503, '{"status": "loading"}'
        with router([a, b], "--poll-interval", "0.2", *extra, ready=1) as url:
            def go() -> None:
                b.health, b.health_body = 200, '{"status": "ok"}'
                assert wait_until(lambda: len(ready_workers(url)) == 2, 10)

            yield url, a, b, go


@pytest.mark.parametrize("fault, reason", [
    ((503, '{"status": "failed"}'), "unhealthy"),  # what a worker with a dead engine says
    (("hang", ""), "unreachable"),  # an event loop that no longer answers: the poll times out
])
def test_a_failing_workers_unanswered_requests_go_elsewhere(fault, reason):
    """A request waits on a worker for its first byte (120 s allowed); the worker fails a
    health poll: the request is sent to the healthy worker and answered, not left to wait."""
    with one_ready_then_two("--first-byte-timeout", "120") as (url, a, b, go), \
            ThreadPoolExecutor(1) as pool:
        a.override = "hang"
        waiting = pool.submit(complete, url, "ok", 60)
        assert wait_until(lambda: a.posts == 1, 10)
        go()
        a.health, a.health_body = fault
        r = waiting.result()
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert (a.posts, b.posts) == (1, 1)
        assert metric(url, names.ROUTER_RETRIES) == 1
        assert samples(url, names.ROUTER_EJECTIONS) == {f'{{reason="{reason}"}}': 1.0}


def test_a_draining_workers_requests_stay_there():
    with one_ready_then_two() as (url, a, b, go), ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, url, "slow:4", 60)
        assert wait_until(lambda: a.posts == 1, 10)
        go()
        a.health, a.health_body = 503, '{"status": "draining"}'
        assert wait_until(lambda: ready_workers(url) == [b.url], 10)
        r = waiting.result()
        assert r.status_code == 200 and (a.posts, b.posts) == (1, 0)
        assert metric(url, names.ROUTER_RETRIES) == 0
        assert samples(url, names.ROUTER_EJECTIONS) == {}


def test_a_first_byte_timeout_ejects_the_worker_and_its_other_requests_move():
    """Round robin over a (hangs) and b: r1 and r3 wait on a; r1's first-byte timeout is a
    504 and ejects a, and r3 goes to b at once rather than wait for its own timeout."""
    with workers(2) as (a, b), router([a, b], "--policy", "round-robin",
                                      "--first-byte-timeout", "4") as url, \
            ThreadPoolExecutor(2) as pool:
        a.override = "hang"
        r1 = pool.submit(complete, url, "one", 60)
        assert wait_until(lambda: a.posts == 1, 10)
        assert complete(url, "two").status_code == 200 and b.posts == 1
        r3 = pool.submit(complete, url, "three", 60)
        assert wait_until(lambda: a.posts == 2, 10)
        first = r1.result()
        assert answer(first)[0] == 504 and first.json()["error"]["code"] == "upstream_timeout"
        third = r3.result()
        assert third.status_code == 200 and b.posts == 2
        assert samples(url, names.ROUTER_EJECTIONS)['{reason="timeout"}'] == 1


def test_a_first_byte_timeout_on_a_worker_still_generating_ends_only_that_request():
    """A long plain answer on a busy worker (its output-token count grows between polls):
    the request's first-byte timeout is its 504, the worker stays ready, its other request
    is answered there, and nothing counts as an ejection."""
    with workers(1) as (a,), router([a], "--first-byte-timeout", "3") as url, \
            ThreadPoolExecutor(2) as pool:
        a.generating = True
        long = pool.submit(complete, url, "hang", 60)
        assert wait_until(lambda: a.posts == 1, 10)
        slow = pool.submit(complete, url, "slow:1", 60)
        first = long.result()
        assert answer(first)[0] == 504 and first.json()["error"]["code"] == "upstream_timeout"
        assert ready_workers(url) == [a.url]
        assert slow.result().status_code == 200 and a.posts == 2
        assert samples(url, names.ROUTER_EJECTIONS) == {}


def test_a_stream_that_stalls_ejects_its_worker():
    with workers(1) as (w,), router([w], "--read-timeout", "1", "--poll-interval", "60") as url:
        r = complete(url, "stall")
        assert r.status_code == 200
        events = [line for line in r.text.split("\n\n") if line]
        assert events[0] == 'data: {"choices":[{"text":"hi","index":0}]}'
        assert json.loads(events[1][6:])["error"]["code"] == "upstream_error"
        assert events[2] == "data: [DONE]"
        assert ready_workers(url) == []  # until a poll finds it well
        assert samples(url, names.ROUTER_EJECTIONS) == {'{reason="timeout"}': 1.0}
        # the 200 is counted, and so is the cut (a break-it pass: a stream cut by a drain
        # deadline showed in no metric)
        assert samples(url, names.ROUTER_BROKEN_STREAMS) == {
            f'{{model="{MODEL}",reason="timeout"}}': 1.0}


@pytest.mark.slow
def test_a_frozen_real_worker_is_ejected_and_its_requests_move(worker_url, model_path, tmp_path):
    """A real worker process frozen with SIGSTOP (connections open, nothing answers: a wedged
    worker) while it holds plain requests: the router's next health poll times out, the
    worker is ejected, and its requests are answered by the other worker, not left to wait
    out the first-byte timeout (600 s here; the client gives up after 300 s)."""
    port = free_port()
    victim = f"http://127.0.0.1:{port}"
    with open(tmp_path / "w.log", "wb") as log:
        proc = start_worker(model_path, port, log)
        try:
            assert wait_until(lambda: health(victim) == 200, 180, period=0.5)
            with serve_router([worker_url, victim], free_port(), "--policy", "round-robin",
                              "--poll-interval", "0.5", "--first-byte-timeout", "600") as url, \
                    ThreadPoolExecutor(4) as pool:
                assert wait_until(lambda: len(ready_workers(url)) == 2, 10)
                body = {"model": MODEL, "prompt": "Tell me about rivers.", "max_tokens": 96,
                        "ignore_eos": True}
                futures = [pool.submit(httpx.post, f"{url}/v1/completions", json=body,
                                       timeout=300) for _ in range(4)]
                assert wait_until(lambda: metric(victim, names.NUM_RUNNING) >= 1, 60)
                os.kill(proc.pid, signal.SIGSTOP)
                answers = [f.result() for f in futures]
                assert [r.status_code for r in answers] == [200] * 4
                assert all(r.json()["usage"]["completion_tokens"] == 96 for r in answers)
                assert metric(url, names.ROUTER_RETRIES) >= 1
                assert samples(url, names.ROUTER_EJECTIONS) == {'{reason="unreachable"}': 1.0}
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------ keep-alive (item 12)

def test_a_kept_alive_connection_closed_under_a_request_is_written_again():
    """The worker closes a kept-alive connection just as the router writes a request on it
    (its idle timeout running out): the request goes again on a new connection to the same
    worker; it is not a failure (no retry used, the worker stays ready)."""
    with workers(1) as (w,), router([w]) as url:
        w.stale = True
        assert complete(url, "ok").status_code == 200  # on a new connection, kept alive
        r = complete(url, "ok")  # on the kept-alive one, closed unanswered, then a new one
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
        assert w.posts == 3
        assert metric(url, names.ROUTER_RETRIES) == 0
        assert ready_workers(url) == [w.url]
        assert samples(url, names.ROUTER_EJECTIONS) == {}


# ------------------------------------------------------------------ the chart (items 5, 6)


def validate(objects: list[dict]) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for version in KUBE_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def pod_labels(objects: list[dict], name: str) -> dict[str, str]:
    return one(objects, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def test_workers_accept_connections_only_from_the_router_and_the_operator(helm):
    from sluice.operator import resources

    objects = render(helm)
    policy = one(objects, "NetworkPolicy", "rel-sluice-workers")
    validate([policy])
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= resources.labels("any-service").items()  # every worker pod
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": resources.WORKER_PORT_NAME, "protocol": "TCP"}]
    router, operator = rule["from"]
    assert router.keys() == operator.keys() == {"podSelector"}  # this namespace only
    assert router["podSelector"]["matchLabels"].items() <= \
        pod_labels(objects, "rel-sluice-router").items()
    assert operator["podSelector"]["matchLabels"].items() <= \
        pod_labels(objects, "rel-sluice-operator").items()
    assert not operator["podSelector"]["matchLabels"].items() <= \
        pod_labels(objects, "rel-sluice-router").items()  # distinct peers


def test_network_policies_per_watched_namespace_and_extra_peers(helm):
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    objects = render(helm, "--set", "operator.watchNamespaces={team-a,sluice-test}",
                     "--set", "router.enabled=false", "--set-json",
                     f"networkPolicy.extraFrom=[{json.dumps(peer)}]")
    policies = {p["metadata"]["namespace"]: p for p in find(objects, "NetworkPolicy")}
    assert sorted(policies) == [NAMESPACE, "team-a"]
    validate(list(policies.values()))
    here = policies[NAMESPACE]["spec"]["ingress"][0]["from"]
    assert here[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    assert here[1:] == [peer]  # no router peer without a router
    there = policies["team-a"]["spec"]["ingress"][0]["from"][0]
    assert there["namespaceSelector"] == {"matchLabels": {
        "kubernetes.io/metadata.name": NAMESPACE}}
    assert find(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []


def test_the_routers_api_keys_come_from_a_secret_mounted_as_a_directory(helm):
    sha = hashlib.sha256(KEY_B.encode()).hexdigest()
    tenants = [{"name": "team-a", "keys": [KEY_A], "maxPriority": -10, "rpm": 600},
               {"name": "team-b", "keySha256": [sha], "tpm": 200000}]
    api_keys = json.dumps({"enabled": True, "tenants": tenants})
    objects = render(helm, "--set-json", f"router.apiKeys={api_keys}",
                     "--set", "router.maxBodyBytes=1048576,router.publicPriority=5")
    secret = one(objects, "Secret", "rel-sluice-router-api-keys")
    deployment = one(objects, "Deployment", "rel-sluice-router")
    validate([secret, deployment])
    parsed, keys = parse_key_file(yaml.safe_load(secret["stringData"]["keys.yaml"]))
    assert parsed == {"team-a": Tenant("team-a", -10, 600.0), "team-b": Tenant("team-b", tpm=2e5)}
    c = container(deployment)
    args = parse_cli("sluice.router.app", "router", c["args"])
    assert (args.api_keys, args.max_body_bytes, args.public_priority) == (
        "/etc/sluice/api-keys/keys.yaml", 1048576, 5)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "api-keys"]
    assert mount == {"name": "api-keys", "mountPath": "/etc/sluice/api-keys", "readOnly": True}
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "api-keys"]
    assert volume["secret"] == {"secretName": "rel-sluice-router-api-keys",
                                "items": [{"key": "keys.yaml", "path": "keys.yaml"}]}


def test_api_keys_from_an_existing_secret_and_defaults(helm):
    objects = render(helm, "--set", "router.apiKeys.enabled=true",
                     "--set", "router.apiKeys.existingSecret=team-keys",
                     "--set", "router.apiKeys.secretKey=tenants.json")
    assert find(objects, "Secret") == []
    deployment = one(objects, "Deployment", "rel-sluice-router")
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == "api-keys"]
    assert volume["secret"]["secretName"] == "team-keys"
    assert "--api-keys=/etc/sluice/api-keys/tenants.json" in container(deployment)["args"]
    defaults = parse_cli("sluice.router.app", "router",
                         container(one(render(helm), "Deployment", "rel-sluice-router"))["args"])
    assert (defaults.api_keys, defaults.max_body_bytes, defaults.public_priority) == (
        None, MAX_BODY_BYTES, 0)


@pytest.mark.parametrize(("values", "message"), [
    (["--set", "router.apiKeys.enabled=true"],
     "router.apiKeys.enabled needs router.apiKeys.existingSecret or router.apiKeys.tenants"),
    (["--set", "router.apiKeys.tenants[0].name=a b"], "router.apiKeys.tenants.0.name"),
    (["--set", "router.apiKeys.tenants[0].name=a,router.apiKeys.tenants[0].rpm=0"],
     "router.apiKeys.tenants.0.rpm"),
    (["--set", "router.publicPriority=-2000"], "router.publicPriority"),
    (["--set", "router.maxBodyBytes=0"], "router.maxBodyBytes"),
])
def test_bad_router_security_values_fail_with_a_message(helm, values, message):
    done = run_helm(helm, "template", RELEASE, str(CHART), *values, check=False)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_autoscaler_and_probe_reads_leave_no_access_log_lines():
    """sluice up's autoscaler reads /autoscale/demand twice a second: like the probes, an
    answered GET of it is not an access-log line; requests are."""
    from sluice.logs import _not_a_probe

    def record(method: str, path: str, status: int) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                                 ("127.0.0.1:1", method, path, "1.1", status), None)
    assert not _not_a_probe(record("GET", "/autoscale/demand", 200))
    assert not _not_a_probe(record("GET", "/health", 503))
    assert _not_a_probe(record("POST", "/v1/completions", 200))
    assert _not_a_probe(record("GET", "/health", 500))


# ------------------------------------------------------------------ at zero replicas

def test_at_zero_a_request_no_worker_would_take_is_refused_without_waking_one(tmp_path):
    """A break-it pass: at zero replicas a request with ``max_tokens: -1`` was held, woke a
    replica and got its 400 from that worker after the cold start. With no replica ready
    the router checks the body with the worker's own request models first: a 400 naming
    the field, no arrival in the demand snapshot (the autoscaler's wake signal), nothing
    held. A valid request is held, then refused with 503 + Retry-After."""
    workers_file = tmp_path / "workers.json"
    workers_file.write_text(json.dumps({"workers": [], "models": [MODEL]}))
    with serve_router([], free_port(), "--discovery", "file", "--workers-file",
                      str(workers_file), "--hold-timeout", "0.3") as url:
        def demand() -> dict:
            return httpx.get(f"{url}/autoscale/demand", timeout=5).json()["models"].get(MODEL, {})

        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        for path, body, param in [
                ("/v1/chat/completions", {**chat, "max_tokens": -1}, "max_tokens"),
                ("/v1/chat/completions", {**chat, "temperature": "hot"}, "temperature"),
                ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -2},
                 "max_tokens")]:
            r = httpx.post(f"{url}{path}", json=body, timeout=10)
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), r.text
        assert demand().get("arrivals", 0) == 0 and demand().get("held", 0) == 0
        r = httpx.post(f"{url}/v1/chat/completions", json={**chat, "max_tokens": 4}, timeout=10)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert (demand()["arrivals"], demand()["rejected"]) == (1, 1)


def test_a_router_stopping_answers_its_held_requests_at_once(tmp_path):
    """A break-it pass: requests held at zero replicas when ``sluice up`` stopped got no
    answer; the router's graceful shutdown waited for them until the supervisor killed it
    10 s later. SIGTERM now answers them 503 + Retry-After, and the router exits."""
    workers_file = tmp_path / "workers.json"
    workers_file.write_text(json.dumps({"workers": [], "models": [MODEL]}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "sluice.cli", "router", "--port", str(port),
                             "--discovery", "file", "--workers-file", str(workers_file),
                             "--hold-timeout", "120"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: health(url) in (200, 503), 30, period=0.2)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body,
                                timeout=60) for _ in range(2)]

            def holding() -> int:
                entry = httpx.get(f"{url}/autoscale/demand", timeout=5).json()["models"]
                return entry.get(MODEL, {}).get("held", 0)
            assert wait_until(lambda: holding() == 2, 10, period=0.1)
            proc.send_signal(signal.SIGTERM)
            answers = [f.result(timeout=30) for f in held]
        assert [r.status_code for r in answers] == [503, 503]
        assert all(int(r.headers["Retry-After"]) >= 1 for r in answers)
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_router_raises_its_open_files_limit_to_the_hard_one():
    """A break-it pass: 1,000 workers under a soft limit of 1,024 open files failed every
    request (one poll connection a worker, kept). The router raises the soft limit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard limit here is {hard}")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice.cli", "router", "--port", str(port), "--worker",
         f"http://127.0.0.1:{free_port()}"], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/livez", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.2)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        expected = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        assert line.split()[3] == str(expected), line
    finally:
        proc.terminate()
        proc.wait(30)
