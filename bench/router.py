"""Router benchmarks: (1) the router's own overhead, (2) routing quality.

1. Overhead. The same closed-loop ``sluice bench`` load against one upstream, several ways:
   direct, through ``sluice router``, through the same router on uvicorn's own HTTP protocol
   (``--http httptools``: what ``sluice.router.http`` saves), through ``vllm-router`` (the
   Rust router from the vLLM project, PyPI ``vllm-router``, run from its own venv; its
   ``round_robin`` and ``cache_aware`` policies). The upstream is a *null worker*
   (this script, ``--serve-null``): an OpenAI-shaped server that streams ``--null-tokens``
   SSE chunks at once, so the latency added by a router is not buried under model time. A
   low-concurrency run gives the added p50/p99 end-to-end latency; a high-concurrency run
   the most requests/s each path carries (on this machine the load generator, the router
   and the null worker share the CPUs: the ratio between paths is the figure to read).

2. Routing quality. ``--replicas`` real ``sluice worker`` processes with small KV pools
   (``--kv-cache-gib``; one thread each), a multi-tenant workload (``--prefix-groups`` G
   system prompts of ``--prefix-tokens`` P tokens, each request P + ``--input-len`` tokens,
   ``--output-len`` out, Poisson ``--rate``), the same request sequence for each policy:
   round-robin, least-load, prefix, slo. Reported: TTFT p50/p90, goodput (requests/s
   meeting ``--slo-ttft-ms``) and the workers' prefix-cache hit rate, as means over
   ``--quality-rounds`` rounds run in alternating order (ABCD, DCBA: a drift in the machine's
   load hits every policy alike). Between runs every worker's prefix cache is flushed with
   unrelated prompts, so no policy inherits another's cache. Only ``slo`` gets an objective
   (and so the admission queue); the others route without queueing. G is taken coprime with the replica count: sluice bench assigns request i to group
   i mod G, and with G a multiple of the replicas round-robin would get perfect affinity
   by accident.

3. Polling. The router polls every worker's /health, /v1/models and /metrics each
   ``--poll-interval`` (1 s). The CPU of one poll round over ``--poll-endpoints`` N
   endpoints (null workers listening on 127.0.0.1-127.0.0.250, as many ports as N needs):
   the router's own poller (``EndpointSet.poll`` on its upstream client), side by side with
   an ``httpx.AsyncClient`` asking the same three GETs of each (the general client the
   poller used before 2026-12-06), both on uvloop in this process.

4. Fleet size. The router's CPU per request in front of ``--scale-workers`` N null
   workers (at the same 250-host addresses; file discovery), closed loop.

    .venv/bin/python bench/router.py [--only overhead|quality|poll|scale] [--num-requests N] ...

Prints tables and writes JSON (default bench/results/router.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sluice.api import metrics as names  # noqa: E402
from sluice.models import store  # noqa: E402

PYTHON = sys.executable
VLLM_ROUTER_VENVS = (ROOT / ".venv-vllm-router", Path("/tmp/vllm-router-venv"),
                     Path("/tmp/vr-venv"))
POLICIES = ("round-robin", "least-load", "prefix", "slo")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------------------- null worker

def serve_null(port: int, tokens: int, model: str, gap_ms: float = 0.0, hosts: int = 1) -> None:
    """An OpenAI-shaped upstream with no model: /health, /v1/models, /metrics, and
    POST /v1/completions or /v1/chat/completions answered at once (``tokens`` SSE chunks
    when streaming, one JSON body otherwise). Raw asyncio HTTP/1.1 with keep-alive.
    ``gap_ms`` > 0 (tests): a stream is sent as it would be generated instead, one event per
    HTTP chunk (chunked transfer encoding), ``gap_ms`` apart. It listens on ``port`` of
    127.0.0.1 to 127.0.0.``hosts`` (Linux routes all of 127/8 to the loopback)."""
    models = json.dumps({"object": "list", "data": [
        {"id": model, "object": "model", "owned_by": "sluice", "max_model_len": 8192}]})

    def chunk(i: int) -> bytes:
        event = json.dumps({"id": "cmpl-null", "object": "text_completion", "created": 0,
                            "model": model, "choices": [{"index": 0, "text": " x",
                                                         "logprobs": None,
                                                         "finish_reason": None if i < tokens - 1
                                                         else "length"}]})
        return f"data: {event}\n\n".encode()

    stream_body = b"".join(chunk(i) for i in range(tokens)) + b"data: [DONE]\n\n"
    plain = json.dumps({"id": "cmpl-null", "object": "text_completion", "created": 0,
                        "model": model, "choices": [{"index": 0, "text": " x" * tokens,
                                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                  "total_tokens": tokens + 1}}).encode()

    def response(status: str, content_type: str, body: bytes) -> bytes:
        return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode() + body

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                length = 0
                for line in lines[1:]:
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if method == "GET" and path == "/v1/models":
                    writer.write(response("200 OK", "application/json", models.encode()))
                elif method == "GET":
                    writer.write(response("200 OK", "application/json", b"{}"))
                elif (b'"stream": true' in body or b'"stream":true' in body) and gap_ms > 0:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n")
                    for event in [chunk(i) for i in range(tokens)] + [b"data: [DONE]\n\n"]:
                        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                        await writer.drain()
                        await asyncio.sleep(gap_ms / 1000)
                    writer.write(b"0\r\n\r\n")
                elif b'"stream": true' in body or b'"stream":true' in body:
                    writer.write(response("200 OK", "text/event-stream", stream_body))
                else:
                    writer.write(response("200 OK", "application/json", plain))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(
            handle, [f"127.0.0.{i}" for i in range(1, hosts + 1)], port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------------------- processes

class Proc:
    """A child process in its own session, with a log; ``ready`` polls a URL."""

    def __init__(self, argv: list[str], log: Path, env: dict | None = None):
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def ready(self, url: str, timeout: float = 300.0, ok=(200,)) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(url, timeout=2).status_code in ok:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{url} not ready in {timeout:.0f} s; log {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_router(workers: list[str], log: Path, *extra: str) -> tuple[Proc, str]:
    port = free_port()
    argv = [PYTHON, "-m", "sluice.cli", "--log-level", "WARNING", "router", "--port", str(port),
            *extra]
    for url in workers:
        argv += ["--worker", url]
    proc = Proc(argv, log)
    url = f"http://127.0.0.1:{port}"
    proc.ready(f"{url}/health", 60)
    return proc, url


def vllm_router_binary() -> tuple[Path | None, str]:
    """The ``vllm-router`` console script, or None and why not."""
    found = shutil.which("vllm-router")
    if found:
        return Path(found), "on PATH"
    for venv in VLLM_ROUTER_VENVS:
        candidate = venv / "bin" / "vllm-router"
        if candidate.exists():
            return candidate, f"from {venv}"
    return None, ("vllm-router is not installed; install it with `python -m venv "
                  "/tmp/vllm-router-venv && /tmp/vllm-router-venv/bin/pip install vllm-router`")


def start_vllm_router(binary: Path, workers: list[str], log: Path,
                      policy: str = "round_robin") -> tuple[Proc, str]:
    port = free_port()
    argv = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--worker-urls", *workers, "--prometheus-port", str(free_port()),
            "--log-level", "warning", "--health-check-interval-secs", "1"]
    proc = Proc(argv, log)
    url = f"http://127.0.0.1:{port}"
    proc.ready(f"{url}/health", 60)
    return proc, url


def bench(url: str, model: str, tokenizer: Path, out: Path, *args: str) -> dict:
    """One ``sluice bench`` run (a subprocess); its summary."""
    argv = [PYTHON, "-m", "sluice.cli", "--log-level", "WARNING", "bench", "--url", url,
            "--model", model, "--tokenizer", str(tokenizer), "--quiet", "--output", str(out),
            *args]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"sluice bench failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())["summary"]


# ---------------------------------------------------------------------------- 3. polling

HOSTS_PER_NULL = 250  # 127.0.0.1-127.0.0.250 on each null worker's port
POLL_PATHS = ("/health", "/v1/models", "/metrics")


def null_fleet(n: int, tmp: Path) -> tuple[list[Proc], Callable[[int], list[str]]]:
    """Null workers answering at ``n`` distinct URLs (127.0.0.1-127.0.0.250 on as many
    ports as ``n`` needs); the processes, and ``urls(k)``: the first k URLs."""
    nulls, ports = [], []
    try:
        for i in range(math.ceil(n / HOSTS_PER_NULL)):
            ports.append(free_port())
            nulls.append(Proc([PYTHON, __file__, "--serve-null", str(ports[-1]),
                               "--null-hosts", str(HOSTS_PER_NULL)], tmp / f"null-{i}.log"))
        for port, null in zip(ports, nulls):
            null.ready(f"http://127.0.0.1:{port}/health", 30)
    except BaseException:
        for null in nulls:
            null.stop()
        raise

    def urls(k: int) -> list[str]:
        return [f"http://127.0.0.{1 + i % HOSTS_PER_NULL}:{ports[i // HOSTS_PER_NULL]}"
                for i in range(k)]
    return nulls, urls


def poll_cost(args, tmp: Path) -> dict:
    """CPU seconds of one poll round, per endpoint count: sluice's poller and httpx."""
    import uvloop

    from sluice.router.endpoints import EndpointSet
    from sluice.router.upstream import Upstream

    result: dict = {"rounds": args.poll_rounds, "rows": []}
    nulls, urls = null_fleet(max(args.poll_endpoints), tmp)
    try:

        async def sluice_round(n: int) -> float:
            endpoints = EndpointSet(urls(n))
            client = Upstream(2.0, 60.0, 4.0)
            try:
                await endpoints.poll(client)  # connections opened, models learnt
                if len(endpoints.ready_for(store.DEFAULT_MODEL)) != n:
                    raise RuntimeError("not every null endpoint answered the poller")
                start = time.process_time()
                for _ in range(args.poll_rounds):
                    for endpoint in endpoints:
                        endpoint.next_poll = 0.0
                    await endpoints.poll(client)
                return (time.process_time() - start) / args.poll_rounds
            finally:
                await client.close()

        async def httpx_round(n: int) -> float:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            async with httpx.AsyncClient(timeout=2.0, limits=limits) as client:

                async def one(url: str) -> None:
                    for path in POLL_PATHS:
                        (await client.get(url + path)).raise_for_status()

                await asyncio.gather(*(one(u) for u in urls(n)))
                rounds = max(1, args.poll_rounds * min(1, 100 // n))  # (1,000: one round)
                start = time.process_time()
                for _ in range(rounds):
                    await asyncio.gather(*(one(u) for u in urls(n)))
                return (time.process_time() - start) / rounds

        for n in args.poll_endpoints:
            ours = uvloop.run(sluice_round(n))
            theirs = uvloop.run(httpx_round(n))
            result["rows"].append({"endpoints": n, "sluice_cpu_ms_per_round": ours * 1e3,
                                   "httpx_cpu_ms_per_round": theirs * 1e3,
                                   "httpx_vs_sluice": theirs / ours})
    finally:
        for null in nulls:
            null.stop()
    return result


# ---------------------------------------------------------------------------- 4. fleet size

def fleet_scale(args, model: Path, tmp: Path) -> dict:
    """The router's CPU per request in front of N null workers, per N (closed loop at
    ``--scale-concurrency``): what routing over a larger fleet costs each request."""
    result: dict = {"concurrency": args.scale_concurrency, "requests": args.scale_requests,
                    "rows": []}
    nulls, urls = null_fleet(max(args.scale_workers), tmp)
    try:
        for n in args.scale_workers:
            workers_file = tmp / f"workers-{n}.json"  # (1,000 --worker flags: a long argv)
            workers_file.write_text(json.dumps({"workers": urls(n)}))
            router, url = start_router([], tmp / f"router-{n}.log", "--discovery", "file",
                                       "--workers-file", str(workers_file))
            try:
                deadline = time.monotonic() + 120
                while sum(w["ready"] for w in httpx.get(f"{url}/health").json()["workers"]) < n:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{n} null workers not all ready in 120 s")
                    time.sleep(0.5)
                bench(url, model.name, model, tmp / f"scale-warm-{n}.json", "--concurrency", "2",
                      "--num-requests", "20", "--input-len", "32", "--output-len",
                      str(args.null_tokens), "--warmup", "2")
                cpu = cpu_seconds(router.proc.pid)
                s = bench(url, model.name, model, tmp / f"scale-{n}.json", "--concurrency",
                          str(args.scale_concurrency), "--num-requests", str(args.scale_requests),
                          "--input-len", "32", "--output-len", str(args.null_tokens),
                          "--warmup", "4")
                cpu_ms = (cpu_seconds(router.proc.pid) - cpu) * 1000 / (args.scale_requests + 4)
                result["rows"].append({"workers": n, "rps": s["rps"], "failed": s["failed"],
                                       "router_cpu_ms_per_request": cpu_ms})
            finally:
                router.stop()
    finally:
        for null in nulls:
            null.stop()
    return result


# ---------------------------------------------------------------------------- 1. overhead

def overhead(args, model: Path, tmp: Path) -> dict:
    null_port = free_port()
    null = Proc([PYTHON, __file__, "--serve-null", str(null_port), "--null-tokens",
                 str(args.null_tokens)], tmp / "null.log")
    upstream = f"http://127.0.0.1:{null_port}"
    procs = [null]
    result: dict = {"upstream": f"null worker, {args.null_tokens} SSE chunks per request",
                    "input_len": 32, "load_average_start": load_average(), "paths": {}}
    try:
        null.ready(f"{upstream}/health", 30)
        paths = {"direct": upstream}
        router, paths["sluice"] = start_router([upstream], tmp / "router.log")
        procs.append(router)
        pids = {"direct": None, "sluice": router.proc.pid}
        # the same router on uvicorn's own HTTP protocol: what sluice.router.http saves
        uvicorn_http, paths["sluice-httptools"] = start_router(
            [upstream], tmp / "router-httptools.log", "--http", "httptools")
        procs.append(uvicorn_http)
        pids["sluice-httptools"] = uvicorn_http.proc.pid
        binary, how = vllm_router_binary()
        if binary is None:
            result["vllm_router"] = {"ran": False, "why": how}
        else:
            try:  # its round robin, and its default (prefix-aware, as sluice's default)
                for name, policy in (("vllm-router", "round_robin"),
                                     ("vllm-router-cache-aware", "cache_aware")):
                    vrouter, paths[name] = start_vllm_router(binary, [upstream],
                                                             tmp / f"{name}.log", policy)
                    procs.append(vrouter)
                    pids[name] = vrouter.proc.pid
                result["vllm_router"] = {"ran": True, "binary": how}
            except (RuntimeError, TimeoutError) as exc:
                result["vllm_router"] = {"ran": False, "why": f"did not start: {exc}"}
        for name, url in paths.items():  # warm every path once
            bench(url, model.name, model, tmp / f"warm-{name}.json", "--concurrency", "2",
                  "--num-requests", "20", "--input-len", "32", "--output-len",
                  str(args.null_tokens), "--warmup", "2")
        for level, concurrency in (("latency", args.latency_concurrency),
                                   ("throughput", args.throughput_concurrency)):
            for round_ in range(args.rounds):  # interleaved: drifts in machine load hit all
                for name, url in paths.items():
                    pid = pids[name]
                    cpu = cpu_seconds(pid) if pid else 0.0
                    s = bench(url, model.name, model, tmp / f"{level}-{name}-{round_}.json",
                              "--concurrency", str(concurrency), "--num-requests",
                              str(args.overhead_requests), "--input-len", "32",
                              "--output-len", str(args.null_tokens), "--warmup", "4",
                              "--seed", str(round_))
                    cpu_ms = (cpu_seconds(pid) - cpu) * 1000 / (args.overhead_requests + 4) \
                        if pid else None
                    row = result["paths"].setdefault(name, {}).setdefault(level, [])
                    row.append({"rps": s["rps"], "ttft_p50_ms": s["ttft_ms"]["p50"],
                                "e2e_p50_ms": s["e2e_ms"]["p50"],
                                "e2e_p99_ms": s["e2e_ms"]["p99"], "failed": s["failed"],
                                "router_cpu_ms_per_request": cpu_ms})
        result["summary"] = summarize_overhead(result["paths"])
        result["load_average_end"] = load_average()
    finally:
        for p in reversed(procs):
            p.stop()
    return result


def _median(values: list[float]) -> float:
    values = sorted(values)
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def summarize_overhead(paths: dict) -> dict:
    """Per path: median over rounds of p50/p99 (latency runs) and of req/s and TTFT p50
    (throughput runs); added latency = path − direct."""
    out: dict = {}
    for name, levels in paths.items():
        lat, thr = levels.get("latency", []), levels.get("throughput", [])
        out[name] = {"e2e_p50_ms": _median([r["e2e_p50_ms"] for r in lat]),
                     "e2e_p99_ms": _median([r["e2e_p99_ms"] for r in lat]),
                     "max_rps": _median([r["rps"] for r in thr]),
                     "ttft_p50_ms_at_max": _median(ttft) if (ttft := [
                         r["ttft_p50_ms"] for r in thr if r.get("ttft_p50_ms") is not None])
                     else None,
                     "router_cpu_ms_per_request": _median(
                         [r["router_cpu_ms_per_request"] for r in thr]) if name != "direct"
                     and thr and thr[0].get("router_cpu_ms_per_request") is not None else None,
                     "failed": sum(r["failed"] for r in lat + thr)}
    direct = out.get("direct")
    for name, row in out.items():
        if direct and name != "direct":
            row["added_p50_ms"] = row["e2e_p50_ms"] - direct["e2e_p50_ms"]
            row["added_p99_ms"] = row["e2e_p99_ms"] - direct["e2e_p99_ms"]
    if "sluice" in out and "vllm-router" in out and out["vllm-router"]["max_rps"]:
        out["sluice_vs_vllm_router_rps"] = out["sluice"]["max_rps"] / out["vllm-router"]["max_rps"]
    for name, key in (("vllm-router", "sluice_vs_vllm_router_cpu"),
                      ("vllm-router-cache-aware", "sluice_vs_vllm_router_cache_aware_cpu"),
                      ("sluice-httptools", "sluice_vs_sluice_httptools_cpu")):
        theirs = out.get(name, {}).get("router_cpu_ms_per_request")
        ours = out.get("sluice", {}).get("router_cpu_ms_per_request")
        if theirs and ours is not None:
            out[key] = ours / theirs
    return out


# ---------------------------------------------------------------------------- 2. quality

def coprime_groups(groups: int, replicas: int) -> int:
    while math.gcd(groups, replicas) != 1:
        groups += 1
    return groups


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(
            rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))
    return total(names.PREFIX_CACHE_HITS), total(names.PREFIX_CACHE_QUERIES)


def flush(workers: list[str], model: str, tokens: int) -> None:
    """Evict every cached prefix: unrelated prompts of ``tokens`` tokens, sent directly."""
    words = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor")

    async def run() -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
                "model": model, "prompt": " ".join(words[(i * 7 + j) % 8] + str(j + i * 1000)
                                                   for j in range(tokens // 3)),
                "max_tokens": 1}) for url in workers for i in range(3)))
    asyncio.run(run())


def quality(args, model: Path, tmp: Path) -> dict:
    groups = coprime_groups(args.prefix_groups, args.replicas)
    result: dict = {"replicas": args.replicas, "kv_cache_gib": args.kv_cache_gib,
                    "prefix_groups": groups, "prefix_tokens": args.prefix_tokens,
                    "input_len": args.input_len, "output_len": args.output_len,
                    "rate": args.rate, "num_requests": args.num_requests,
                    "rounds": args.quality_rounds,
                    "slo_ttft_ms": args.slo_ttft_ms, "policies": {}}
    workers: list[Proc] = []
    urls: list[str] = []
    try:
        for i in range(args.replicas):
            port = free_port()
            workers.append(Proc([PYTHON, "-m", "sluice.cli", "--log-level", "WARNING", "worker",
                                 "--model", str(model), "--port", str(port),
                                 "--kv-cache-gib", str(args.kv_cache_gib),
                                 "--max-num-seqs", "16"], tmp / f"worker{i}.log",
                                env={"OMP_NUM_THREADS": "1"}))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(workers, urls):
            proc.ready(f"{url}/health", 600)
        orders = [list(args.policies) if r % 2 == 0 else list(reversed(args.policies))
                  for r in range(args.quality_rounds)]  # ABCD DCBA ...: drifts hit all
        runs: dict[str, list[dict]] = {p: [] for p in args.policies}
        for round_, order in enumerate(orders):
            for policy in order:
                row = quality_run(args, model, tmp, urls, groups, policy, round_)
                runs[policy].append(row)
                print(f"round {round_} {policy}: TTFT p90 {row['ttft_p90_ms']:.0f} ms, goodput "
                      f"{row['goodput_rps'] or 0:.2f} req/s, load {row['load_average']}", flush=True)
        for policy, rows in runs.items():
            result["policies"][policy] = {**{k: _mean([r[k] for r in rows]) for k in (
                "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p50_ms", "rps", "goodput_rps",
                "goodput_fraction", "prefix_hit_rate", "ttft_prediction_mape")},
                "failed": sum(r["failed"] for r in rows), "runs": rows}
    finally:
        for p in workers:
            p.stop()
    rr = result["policies"].get("round-robin")
    if rr:
        for name, row in result["policies"].items():
            row["ttft_p90_vs_round_robin"] = (row["ttft_p90_ms"] / rr["ttft_p90_ms"]
                                              if rr["ttft_p90_ms"] else None)
            row["goodput_vs_round_robin"] = (row["goodput_rps"] / rr["goodput_rps"]
                                             if rr["goodput_rps"] else None)
    return result


def quality_run(args, model: Path, tmp: Path, urls: list[str], groups: int, policy: str,
                round_: int) -> dict:
    """One policy over the running workers, after flushing their prefix caches."""
    flush(urls, model.name, args.prefix_tokens + 128)
    before = [prefix_counters(u) for u in urls]
    extra = ["--policy", policy, "--slo-ttft-ms",
             str(args.slo_ttft_ms) if policy == "slo" else "0"]  # others: no queueing
    router, url = start_router(urls, tmp / f"router-{policy}-{round_}.log", *extra)
    try:
        s = bench(url, model.name, model, tmp / f"quality-{policy}-{round_}.json",
                  "--rate", str(args.rate), "--num-requests", str(args.num_requests),
                  "--prefix-groups", str(groups), "--prefix-tokens", str(args.prefix_tokens),
                  "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                  "--warmup", "0", "--slo-ttft-ms", str(args.slo_ttft_ms), "--seed", "1")
        mape = _router_metric(url, names.ROUTER_TTFT_PREDICTION_MAPE)
    finally:
        router.stop()
    after = [prefix_counters(u) for u in urls]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    return {"round": round_, "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p90_ms": s["ttft_ms"]["p90"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "e2e_p50_ms": s["e2e_ms"]["p50"], "rps": s["rps"],
            "goodput_rps": (s["goodput"] or {}).get("rps"),
            "goodput_fraction": (s["goodput"] or {}).get("fraction"),
            "failed": s["failed"], "errors": s["errors"],
            "prefix_hit_rate": hits / queries if queries else None,
            "ttft_prediction_mape": mape if policy == "slo" else None,
            "load_average": load_average()}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _router_metric(url: str, name: str) -> float | None:
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    found = re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found[0]) if found else None


# ---------------------------------------------------------------------------- output

def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_tables(result: dict) -> None:
    over = result.get("overhead")
    if over:
        print(f"\nRouter overhead ({over['upstream']}; load average {result['load_average']})")
        print(f"{'path':<23} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} "
              f"{'max req/s':>10} {'TTFT p50 @max':>14} {'router CPU ms/req':>18}")
        for name, row in over["summary"].items():
            if not isinstance(row, dict):
                continue
            print(f"{name:<23} {_fmt(row['e2e_p50_ms'], 2):>8} {_fmt(row['e2e_p99_ms'], 2):>8} "
                  f"{_fmt(row.get('added_p50_ms'), 2):>8} {_fmt(row.get('added_p99_ms'), 2):>8} "
                  f"{_fmt(row['max_rps']):>10} {_fmt(row.get('ttft_p50_ms_at_max'), 1):>14} "
                  f"{_fmt(row.get('router_cpu_ms_per_request'), 3):>18}")
        for key, what in (("sluice_vs_vllm_router_rps", "sluice / vllm-router req/s"),
                          ("sluice_vs_vllm_router_cpu", "sluice / vllm-router CPU per request"),
                          ("sluice_vs_vllm_router_cache_aware_cpu",
                           "sluice / vllm-router (cache_aware) CPU per request"),
                          ("sluice_vs_sluice_httptools_cpu",
                           "sluice / sluice on uvicorn's HTTP protocol, CPU per request")):
            if key in over["summary"]:
                print(f"{what}: {over['summary'][key]:.2f}x")
        if not over.get("vllm_router", {}).get("ran", True):
            print(f"vllm-router: not run: {over['vllm_router']['why']}")
    poll = result.get("poll")
    if poll:
        print(f"\nPolling: CPU of one round of {', '.join(POLL_PATHS)} per endpoint "
              f"(mean of {poll['rounds']} rounds; one round a second by default)")
        print(f"{'endpoints':>9} {'sluice ms':>10} {'ms/endpoint':>12} {'httpx ms':>10} "
              f"{'httpx/sluice':>13}")
        for row in poll["rows"]:
            n = row["endpoints"]
            print(f"{n:>9} {row['sluice_cpu_ms_per_round']:>10.1f} "
                  f"{row['sluice_cpu_ms_per_round'] / n:>12.3f} "
                  f"{row['httpx_cpu_ms_per_round']:>10.1f} {row['httpx_vs_sluice']:>12.1f}x")
    scale = result.get("scale")
    if scale:
        print(f"\nFleet size: router CPU per request in front of N null workers "
              f"(closed loop, concurrency {scale['concurrency']}, {scale['requests']} requests)")
        print(f"{'workers':>8} {'req/s':>8} {'failed':>7} {'router CPU ms/req':>18}")
        for row in scale["rows"]:
            print(f"{row['workers']:>8} {row['rps']:>8.1f} {row['failed']:>7} "
                  f"{row['router_cpu_ms_per_request']:>18.3f}")
    qual = result.get("quality")
    if qual:
        print(f"\nRouting quality: {qual['replicas']} workers, KV {qual['kv_cache_gib']} GiB each, "
              f"{qual['prefix_groups']} tenants × {qual['prefix_tokens']}-token prefix + "
              f"{qual['input_len']} in / {qual['output_len']} out, Poisson {qual['rate']}/s, "
              f"{qual['num_requests']} requests, SLO TTFT {qual['slo_ttft_ms']:.0f} ms")
        print(f"{'policy':<12} {'TTFT p50':>9} {'TTFT p90':>9} {'goodput/s':>10} {'good %':>7} "
              f"{'hit rate':>9} {'p90 vs rr':>10} {'good vs rr':>11}")
        for name, row in qual["policies"].items():
            frac = row["goodput_fraction"]
            print(f"{name:<12} {_fmt(row['ttft_p50_ms'], 0):>9} {_fmt(row['ttft_p90_ms'], 0):>9} "
                  f"{_fmt(row['goodput_rps'], 2):>10} {_fmt(frac * 100 if frac is not None else None, 0):>7} "
                  f"{_fmt(row['prefix_hit_rate'], 2):>9} "
                  f"{_fmt(row.get('ttft_p90_vs_round_robin'), 2):>10} "
                  f"{_fmt(row.get('goodput_vs_round_robin'), 2):>11}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("overhead", "quality", "poll", "scale"))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "router.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the other part's results already in --out (with --only)")
    g = p.add_argument_group("overhead")
    g.add_argument("--null-tokens", type=int, default=16)
    g.add_argument("--null-gap-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    g.add_argument("--latency-concurrency", type=int, default=1)
    g.add_argument("--throughput-concurrency", type=int, default=32)
    g.add_argument("--overhead-requests", type=int, default=400)
    g.add_argument("--rounds", type=int, default=3)
    g = p.add_argument_group("quality")
    g.add_argument("--replicas", type=int, default=4)
    g.add_argument("--kv-cache-gib", type=float, default=0.06)
    g.add_argument("--prefix-groups", type=int, default=7)
    g.add_argument("--prefix-tokens", type=int, default=384)
    g.add_argument("--input-len", default="32")
    g.add_argument("--output-len", default="16")
    g.add_argument("--rate", type=float, default=2.0)
    g.add_argument("--num-requests", type=int, default=80)
    g.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    g.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    g.add_argument("--quality-rounds", type=int, default=2,
                   help="rounds over the policies, alternating order; figures are means")
    g = p.add_argument_group("poll")
    g.add_argument("--poll-endpoints", type=int, nargs="+", default=[10, 100, 1000])
    g.add_argument("--poll-rounds", type=int, default=5)
    g = p.add_argument_group("scale")
    g.add_argument("--scale-workers", type=int, nargs="+", default=[1, 100, 1000])
    g.add_argument("--scale-concurrency", type=int, default=200)
    g.add_argument("--scale-requests", type=int, default=2000)
    p.add_argument("--serve-null", type=int, metavar="PORT", help=argparse.SUPPRESS)
    p.add_argument("--null-hosts", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve_null:
        serve_null(args.serve_null, args.null_tokens, store.DEFAULT_MODEL, args.null_gap_ms,
                   args.null_hosts)
        return 0
    model = store.fetch(store.DEFAULT_MODEL)
    result: dict = {"model": model.name, "cpus": os.cpu_count(), "load_average": load_average(),
                    "settings": {k: v for k, v in vars(args).items() if k != "serve_null"}}
    with tempfile.TemporaryDirectory(prefix="sluice-bench-router-") as tmp:
        if args.only in (None, "overhead"):
            result["overhead"] = overhead(args, model, Path(tmp))
        if args.only in (None, "quality"):
            result["quality"] = quality(args, model, Path(tmp))
        if args.only in (None, "poll"):
            result["poll"] = poll_cost(args, Path(tmp))
        if args.only in (None, "scale"):
            result["scale"] = fleet_scale(args, model, Path(tmp))
    result["load_average_end"] = load_average()
    print_tables(result)
    out = Path(args.out)
    if args.merge and args.only and out.exists():
        previous = json.loads(out.read_text())
        for other in {"overhead", "quality", "poll", "scale"} - {args.only}:
            if other in previous:
                result[other] = previous[other]
                result[f"{other}_settings"] = previous.get(f"{other}_settings",
                                                          previous.get("settings"))
    result[f"{args.only or 'all'}_settings"] = result["settings"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
