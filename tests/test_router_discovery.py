"""Kubernetes discovery of the router: the pure Endpoints → endpoint-set translation with
exact values, the endpoint set's listing rules, the list/watch loop against scripted
responses, and a real router process whose kubernetes client lists and watches a small
in-process API server (list + chunked watch + 410) in front of two fake workers.

The real-apiserver proof is in e2e/; this file needs no cluster and no model.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from conftest import free_port, http_stub, serve
from sluice.api.service import served_model
from sluice.router.discovery import Discovered, Reflector, discovered, ready_urls
from sluice.router.endpoints import EndpointSet, Lease
from sluice.router.upstream import Upstream

MODEL = "tiny-model"


# ------------------------------------------------------------------ pure translation

def test_ready_urls_takes_only_ready_addresses_on_the_http_port():
    endpoints = {
        "metadata": {"name": "smollm2-worker"},
        "subsets": [
            {"addresses": [{"ip": "10.244.0.9"}, {"ip": "10.244.0.7", "targetRef": {"kind": "Pod"}}],
             "notReadyAddresses": [{"ip": "10.244.0.8"}],
             "ports": [{"name": "metrics", "port": 9090}, {"name": "http", "port": 8000,
                                                          "protocol": "TCP"}]},
            {"notReadyAddresses": [{"ip": "10.244.1.2"}],
             "ports": [{"name": "http", "port": 8000}]},
            {"addresses": [{"ip": "10.244.2.3"}], "ports": [{"name": "metrics", "port": 9090}]},
            {"addresses": [{"ip": "fd00::5"}, {"ip": "10.244.0.7"}],
             "ports": [{"name": "http", "port": 8000}]},
        ],
    }
    assert ready_urls(endpoints) == ["http://10.244.0.7:8000", "http://10.244.0.9:8000",
                                     "http://[fd00::5]:8000"]


def test_ready_urls_edge_cases():
    assert ready_urls({"metadata": {"name": "x"}}) == []  # no subsets: nothing ready yet
    assert ready_urls({"subsets": None}) == []
    assert ready_urls({"subsets": [{"addresses": [{"ip": "10.0.0.1"}]}]}) == []  # no ports
    # a one-port Service may leave its port unnamed: that port is the one
    assert ready_urls({"subsets": [{"addresses": [{"ip": "10.0.0.1"}],
                                    "ports": [{"port": 8000}]}]}) == ["http://10.0.0.1:8000"]
    # two unnamed-or-other ports: no guessing
    assert ready_urls({"subsets": [{"addresses": [{"ip": "10.0.0.1"}],
                                    "ports": [{"name": "a", "port": 1},
                                              {"name": "b", "port": 2}]}]}) == []
    assert ready_urls({"subsets": [{"addresses": [{"ip": "10.0.0.1"}],
                                    "ports": [{"name": "api", "port": 9}]}]},
                      port_name="api") == ["http://10.0.0.1:9"]


def test_served_model():
    assert served_model({"spec": {"model": {"name": "SmolLM2-135M-Instruct",
                                            "source": "sluice://SmolLM2-135M-Instruct"}}}) \
        == "SmolLM2-135M-Instruct"
    assert served_model({"spec": {}}) is None
    assert served_model({}) is None
    assert served_model({"spec": {"model": {"name": ""}}}) is None


def test_discovered_joins_inferenceservices_with_their_worker_endpoints():
    models = {"smollm2": "SmolLM2-135M-Instruct", "qwen": "Qwen2.5-Coder-0.5B-Instruct",
              "broken": None, "starting": "Starting-Model"}
    urls = {"smollm2-worker": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"],
            "qwen-worker": ["http://10.0.1.1:8000"],
            "broken-worker": ["http://10.0.9.9:8000"],   # no model name: not routable
            "unrelated": ["http://10.0.5.5:8000"],       # not a worker Service of ours
            "smollm2": ["http://10.0.7.7:8000"]}         # the InferenceService's own name
    assert discovered(models, urls) == Discovered(
        urls={"http://10.0.0.1:8000": "SmolLM2-135M-Instruct",
              "http://10.0.0.2:8000": "SmolLM2-135M-Instruct",
              "http://10.0.1.1:8000": "Qwen2.5-Coder-0.5B-Instruct"},
        models=frozenset({"SmolLM2-135M-Instruct", "Qwen2.5-Coder-0.5B-Instruct",
                          "Starting-Model"}))
    assert discovered({}, urls) == Discovered({}, frozenset())


# ------------------------------------------------------------------ the endpoint set's listing

def test_a_model_at_zero_replicas_keeps_its_last_v1_models_entry():
    """Found by a fresh user: at zero replicas ``/v1/models`` listed the model with a
    minimal entry, without the ``max_model_len`` clients size their prompts by. It keeps
    the last entry a worker gave; a model no worker ever served gets the minimal one."""
    endpoints = EndpointSet()
    endpoints.sync(["http://a:8000"], [MODEL, "never"])
    a = next(iter(endpoints))
    entry = {"id": MODEL, "object": "model", "created": 7, "owned_by": "sluice",
             "max_model_len": 8192}
    a.ready, a.models = True, {MODEL: entry}
    never = {"id": "never", "object": "model", "created": 0, "owned_by": "sluice"}
    assert endpoints.model_entries() == [never, entry]  # sorted by id
    endpoints.sync([], [MODEL, "never"])  # scaled to zero
    assert endpoints.model_entries() == [never, entry]


def test_sync_lists_unlists_and_forgets_after_the_last_request():
    endpoints = EndpointSet()
    assert not endpoints.any_models_known() and not endpoints.serves(MODEL)
    endpoints.sync(["http://b:8000", "http://a:8000/"], [MODEL, "starting"])
    assert [e.url for e in endpoints] == ["http://a:8000", "http://b:8000"]
    assert endpoints.any_models_known()              # discovery has spoken: 404 is real
    assert endpoints.serves("starting") and not endpoints.serves("other")
    assert endpoints.ready_for(MODEL) == []          # not ready until a poll confirms
    a, b = list(endpoints)
    for e in (a, b):
        e.ready, e.models = True, {MODEL: {"id": MODEL}}
    assert endpoints.ready_for(MODEL) == [a, b]

    lease = Lease(a, 0.0, 0.0)
    endpoints.sync(["http://b:8000"], [MODEL])       # a left the ready addresses
    assert endpoints.ready_for(MODEL) == [b] and endpoints.any_ready()
    assert [e.url for e in endpoints] == ["http://a:8000", "http://b:8000"]  # a drains
    assert [e.url for e in endpoints.listed()] == ["http://b:8000"]
    assert [m["id"] for m in endpoints.model_entries()] == [MODEL]
    assert (a.listed, a.ready, a.in_flight) == (False, False, 1)

    endpoints.sync(["http://a:8000", "http://b:8000"], [MODEL])  # back before it drained
    assert list(endpoints)[0] is a and a.in_flight == 1          # same object, same count
    assert endpoints.ready_for(MODEL) == [b]                     # needs a poll again
    endpoints.sync(["http://b:8000"], [MODEL])
    lease.release(0.0)
    endpoints.prune()                                            # the poller calls this
    assert [e.url for e in endpoints] == ["http://b:8000"]

    endpoints.sync([], [])
    assert list(endpoints) == [] and not endpoints.serves(MODEL)
    assert endpoints.any_models_known() and not endpoints.any_ready()


def _ready_worker(seen: list[str] | None = None):
    """``http_stub``'s answers of a ready worker serving MODEL; each path goes to ``seen``."""
    def answer(path: str) -> tuple[int, object]:
        if seen is not None:
            seen.append(path)
        if path == "/health":
            return 200, {"status": "ok"}
        return 200, {"object": "list", "data": [{"id": MODEL}]}
    return answer


def test_unlisted_endpoints_are_not_polled():
    seen_a, seen_b = [], []

    async def scenario():
        async with http_stub(_ready_worker(seen_a)) as a, http_stub(_ready_worker(seen_b)) as b:
            endpoints = EndpointSet()
            endpoints.sync([a, b], [MODEL])
            client = Upstream(1.0, 2.0, 4.0)
            await endpoints.poll(client)
            assert [e.url for e in endpoints.ready_for(MODEL)] == sorted([a, b])
            Lease(next(e for e in endpoints if e.url == a), 0.0, 0.0)
            endpoints.sync([b], [MODEL])
            seen_a.clear()
            seen_b.clear()
            await endpoints.poll(client)
            assert seen_a == [] and sorted(seen_b) == ["/health", "/metrics", "/v1/models"]
            assert [e.url for e in endpoints.ready_for(MODEL)] == [b]
            await client.close()

    asyncio.new_event_loop().run_until_complete(scenario())


def test_a_newly_listed_endpoint_is_polled_at_once():
    """A worker that joins the ready addresses is confirmed by a poll right away, not at the
    next poll interval (30 s here)."""
    endpoints = EndpointSet(poll_interval=30.0)

    async def scenario():
        async with http_stub(_ready_worker()) as a:
            client = Upstream(1.0, 2.0, 4.0)
            poller = asyncio.create_task(endpoints.poll_forever(client))
            await asyncio.sleep(0.05)                    # the first (empty) poll is done
            endpoints.sync([a], [MODEL])
            started = time.monotonic()
            while not endpoints.ready_for(MODEL) and time.monotonic() - started < 5:
                await asyncio.sleep(0.01)
            waited = time.monotonic() - started
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
            await client.close()
            return a, waited

    a, waited = asyncio.new_event_loop().run_until_complete(scenario())
    assert [e.url for e in endpoints.ready_for(MODEL)] == [a] and waited < 2


# ------------------------------------------------------------------ the list/watch loop

class _Response:
    """A urllib3-like response: ``data`` for a list, ``stream`` for a watch."""

    def __init__(self, body=None, events=()):
        self.data = json.dumps(body).encode() if body is not None else b""
        # split lines at odd places, as a chunked stream may
        raw = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self._chunks = [raw[i:i + 7] for i in range(0, len(raw), 7)]
        self.closed = False

    def stream(self, amt=None, decode_content=False):
        yield from self._chunks

    def close(self):
        self.closed = True

    def release_conn(self):
        pass


def _ep(name, rv, *ips):
    return {"metadata": {"name": name, "resourceVersion": rv},
            "subsets": [{"addresses": [{"ip": ip} for ip in ips],
                         "ports": [{"name": "http", "port": 8000}]}] if ips else []}


def test_reflector_lists_applies_events_resumes_and_relists_after_410():
    from kubernetes.client.exceptions import ApiException

    stop = threading.Event()
    calls = []
    script = [
        _Response({"metadata": {"resourceVersion": "10"},
                   "items": [_ep("a-worker", "9", "10.0.0.1")]}),
        _Response(events=[
            {"type": "ADDED", "object": _ep("b-worker", "11", "10.0.0.2")},
            {"type": "MODIFIED", "object": _ep("a-worker", "12")},          # a: none ready
            {"type": "MODIFIED", "object": _ep("b-worker", "13", "10.0.0.2")},  # no change
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}},
        ]),
        _Response(events=[{"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                       "message": "too old"}}]),
        _Response({"metadata": {"resourceVersion": "30"},
                   "items": [_ep("b-worker", "13", "10.0.0.2"), _ep("c-worker", "29")]}),
        _Response(events=[{"type": "DELETED", "object": _ep("b-worker", "31")}]),
        ApiException(status=500, reason="apiserver restarting"),
        _Response({"metadata": {"resourceVersion": "40"}, "items": []}),
    ]
    views = []

    def list_call(**kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "_request_timeout"})
        if not script:
            stop.set()
            raise ApiException(status=503, reason="end of script")
        item = script.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    lock = threading.Lock()
    reflector = Reflector("endpoints", list_call, ready_urls,
                          lambda: views.append(dict(reflector.view)), lock, stop, watch_timeout=5)
    started = time.monotonic()
    reflector.run()
    assert time.monotonic() - started < 5  # one backoff of 0.5 s, then the script ends

    assert views == [
        {"a-worker": ["http://10.0.0.1:8000"]},                                  # list
        {"a-worker": ["http://10.0.0.1:8000"], "b-worker": ["http://10.0.0.2:8000"]},
        {"a-worker": [], "b-worker": ["http://10.0.0.2:8000"]},                  # (13: no-op)
        {"b-worker": ["http://10.0.0.2:8000"], "c-worker": []},                  # relist
        {"c-worker": []},                                                        # DELETED
        {},                                                                      # relist
    ]
    watch = {"watch": True, "allow_watch_bookmarks": True, "timeout_seconds": 5,
             "_preload_content": False}
    assert calls == [
        {"_preload_content": False},
        {**watch, "resource_version": "10"},
        {**watch, "resource_version": "20"},   # resumed after the bookmark
        {"_preload_content": False},           # 410 → relist at once
        {**watch, "resource_version": "30"},
        {**watch, "resource_version": "31"},   # the 500 → back off, relist
        {"_preload_content": False},
        {**watch, "resource_version": "40"},
    ]


# ------------------------------------------------------------------ a router process, a fake API

GROUP_PATH = "/apis/serving.sluice.dev/v1alpha1/namespaces/ns/inferenceservices"
CORE_PATH = "/api/v1/namespaces/ns/endpoints"


class FakeApiServer:
    """Just enough of the Kubernetes API for list and watch of two namespaced collections:
    resourceVersions, chunked watch streams that end at ``timeoutSeconds``, and ``410`` for a
    watch from before ``expire_before``."""

    def __init__(self):
        self.cond = threading.Condition()
        self.rv = 100
        self.objects: dict[str, dict[str, dict]] = {GROUP_PATH: {}, CORE_PATH: {}}
        self.log: list[tuple[int, str, str, dict]] = []
        self.expire_before = 0
        self.generation = 0  # bumping it ends every open watch
        self.closed = False
        self.requests: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append((url.path, query))
                if url.path not in fake.objects:
                    body = json.dumps({"kind": "Status", "code": 404}).encode()
                    self.send_response(404)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if query.get("watch") == "true":
                    fake._watch(self, url.path, query)
                else:
                    with fake.cond:
                        body = json.dumps({"metadata": {"resourceVersion": str(fake.rv)},
                                           "items": list(fake.objects[url.path].values())})
                    data = body.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _watch(self, handler, path, query):
        since = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + int(query.get("timeoutSeconds", 30))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()

        def send(event):
            line = json.dumps(event).encode() + b"\n"
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            handler.wfile.flush()

        try:
            with self.cond:
                generation = self.generation
                if since < self.expire_before:
                    send({"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                      "reason": "Expired", "message": "too old"}})
                else:
                    while not self.closed and generation == self.generation:
                        for rv, p, kind, obj in self.log:
                            if rv > since and p == path:
                                send({"type": kind, "object": obj})
                                since = rv
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.cond.wait(min(left, 0.5))
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except OSError:
            pass

    def put(self, path, obj):
        with self.cond:
            self.rv += 1
            obj = copy.deepcopy(obj)
            obj["metadata"]["resourceVersion"] = str(self.rv)
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.objects[path] else "ADDED"
            self.objects[path][name] = obj
            self.log.append((self.rv, path, kind, obj))
            self.cond.notify_all()

    def delete(self, path, name):
        with self.cond:
            self.rv += 1
            obj = self.objects[path].pop(name)
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.rv)}}
            self.log.append((self.rv, path, "DELETED", obj))
            self.cond.notify_all()

    def expire_watches(self):
        """End every open watch; the next watch from an old version gets 410."""
        with self.cond:
            self.expire_before = self.rv + 1
            self.generation += 1
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


class FakeWorker:
    """A worker that is always ready and says who answered; ``hold`` parks chat requests
    until ``release`` is set."""

    def __init__(self, name):
        self.name = name
        self.hold = False
        self.release = threading.Event()
        self.served = 0
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._json(200, {"status": "ok"})
                elif self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
                else:
                    self._json(404, {})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if worker.hold:
                    worker.release.wait(30)
                worker.served += 1
                self._json(200, {"worker": worker.name})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def _isvc(name, model):
    return {"apiVersion": "serving.sluice.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"model": {"name": model, "source": f"sluice://{model}"}}}


def _endpoints(name, ready=(), not_ready=()):
    """Endpoints of fake workers on 127.0.0.1: one subset per port (ports differ)."""
    subsets = [{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "http", "port": p}]}
               for p in ready]
    subsets += [{"notReadyAddresses": [{"ip": "127.0.0.1"}],
                 "ports": [{"name": "http", "port": p}]} for p in not_ready]
    return {"metadata": {"name": name, "namespace": "ns"}, "subsets": subsets}


def _wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def cluster(tmp_path):
    api, a, b = FakeApiServer(), FakeWorker("a"), FakeWorker("b")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}]}))
    yield api, a, b, kubeconfig
    for server in (a, b, api):
        server.close()


def test_router_follows_inferenceservices_and_ready_endpoints(cluster, tmp_path):
    api, a, b, kubeconfig = cluster
    api.put(GROUP_PATH, _isvc("tiny", MODEL))
    api.put(CORE_PATH, _endpoints("tiny-worker", ready=[a.port], not_ready=[b.port]))
    api.put(CORE_PATH, _endpoints("other-worker", ready=[b.port]))  # no InferenceService
    port = free_port()
    args = ["router", "--discovery", "kubernetes", "--kubeconfig", str(kubeconfig),
            "--namespace", "ns", "--port", str(port), "--poll-interval", "0.2"]
    with serve(args, port, timeout=30, log=tmp_path / "router.log") as url, \
            httpx.Client(base_url=url, timeout=10) as http, ThreadPoolExecutor(4) as pool:
        def ask(model=MODEL):
            return http.post("/v1/chat/completions", json={  # a valid body: at zero ready
                "model": model, "messages": [{"role": "user", "content": "hi"}]})  # it is checked

        def workers():
            return {w["url"]: w for w in http.get("/health").json()["workers"]}

        def listed():
            return {url: w["listed"] for url, w in workers().items()}

        a_url, b_url = f"http://127.0.0.1:{a.port}", f"http://127.0.0.1:{b.port}"

        # only the ready address of the InferenceService's own worker Service
        assert {ask().json()["worker"] for _ in range(4)} == {"a"}
        assert http.get("/v1/models").json()["data"] == [{"id": MODEL, "object": "model"}]
        assert ask("nope").status_code == 404
        assert http.get("/livez").json() == {"status": "ok"}

        # a request in flight on a, then a leaves the ready addresses and b joins
        a.hold = True
        held = pool.submit(ask)
        _wait_for(lambda: workers()[a_url]["in_flight"] == 1, what="the held request on a")
        api.put(CORE_PATH, _endpoints("tiny-worker", ready=[b.port], not_ready=[a.port]))
        _wait_for(lambda: listed() == {a_url: False, b_url: True}, what="a unlisted")
        _wait_for(lambda: ask().status_code == 200, what="b confirmed by a poll")
        assert {ask().json()["worker"] for _ in range(4)} == {"b"}  # no new request on a
        served_by_a = a.served
        a.release.set()
        assert held.result(10).json() == {"worker": "a"}            # ...the old one finished
        assert a.served == served_by_a + 1
        _wait_for(lambda: listed() == {b_url: True}, what="drained a forgotten")

        # the watch expires (410); changes made meanwhile arrive through a relist
        api.expire_watches()
        api.put(CORE_PATH, _endpoints("tiny-worker", not_ready=[a.port, b.port]))
        _wait_for(lambda: ask().status_code == 503, what="no ready worker after the relist")
        assert ask().json()["error"]["code"] == "no_ready_worker"  # declared model: 503, not 404

        api.delete(GROUP_PATH, "tiny")
        _wait_for(lambda: ask().status_code == 404, what="the deleted model to be unknown")
        stopping = time.monotonic()
    # SIGTERM ends the router at once: no watch thread holds up its shutdown
    assert time.monotonic() - stopping < 10

    from sluice.api.names import MANAGED_SELECTOR
    assert {q.get("labelSelector") for p, q in api.requests if p == CORE_PATH} == {MANAGED_SELECTOR}
    assert {q.get("labelSelector") for p, q in api.requests if p == GROUP_PATH} == {None}
    watches = [q for p, q in api.requests if q.get("watch") == "true"]
    assert watches and all(int(q["timeoutSeconds"]) > 0 for q in watches)
    assert {p for p, q in api.requests if q.get("watch") != "true"} == {GROUP_PATH, CORE_PATH}
    assert sum(1 for p, q in api.requests if q.get("watch") != "true" and p == CORE_PATH) >= 2


def test_joined_serves_cascades_whose_tiers_resolve_and_declares_no_model_for_them():
    from sluice.api.service import CascadeSpec
    from sluice.router.discovery import ServiceView, joined

    spec = CascadeSpec.model_validate({"tiers": ["a", "b"], "escalation": {"threshold": -1}})
    broken = spec.model_copy(update={"tiers": ["a", "missing"]})
    views = {"a": ServiceView("tier-a"), "b": ServiceView("tier-b"),
             "c": ServiceView("coder", cascade=spec), "d": ServiceView("bad", cascade=broken)}
    urls = {"a-worker": ["http://10.0.0.1:8000"], "b-worker": ["http://10.0.0.2:8000"]}
    found, settings, cascades = joined(views, urls)
    assert found.models == frozenset({"tier-a", "tier-b"})  # no "coder", no "bad"
    assert found.urls == {"http://10.0.0.1:8000": "tier-a", "http://10.0.0.2:8000": "tier-b"}
    assert list(cascades) == ["coder"]
    assert cascades["coder"].policy.models == ("tier-a", "tier-b")
    assert cascades["coder"].policy.tiers == ("a", "b")
