"""`sluice worker`: one model served over the OpenAI HTTP API (FastAPI + uvicorn).

uvicorn starts at once and the engine loads on a background thread: ``/health`` answers 503
until the model is ready, 200 after, and 503 again once SIGTERM starts the graceful drain
(in-flight requests finish, then the engine shuts down).

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /metrics (Prometheus, vLLM names), /tokenizer_info.

Request path: validate (sluice.api.openai models; every client error is a 4xx OpenAI error
body, raised before a stream starts) → tokenize off the event loop → one engine request per
choice (a prompt of a list, or one of ``n``) → the deltas are shaped into chunks (SSE) or
one response. A client that goes away aborts its engine requests: for streams the response
generator is closed; for plain responses a watcher on the ASGI ``receive`` channel cancels
the work.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.api import metrics as names
from sluice.api import openai as oa
from sluice.models import store
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.outputs import RequestOutput
from sluice.worker.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class Engine(Protocol):
    """What the server needs from sluice.worker.engine.async_engine.AsyncEngine."""

    tokenizer: Any
    max_model_len: int
    model_name: str

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]: ...
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def stats(self) -> Any: ...
    def shutdown(self) -> None: ...


# --------------------------------------------------------------------------- CLI

_ENGINE_FLAGS = ("max_model_len", "block_size", "kv_cache_gib", "max_num_seqs",
                 "max_num_batched_tokens", "dtype", "device")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags; engine flags map 1:1 onto EngineConfig (same defaults)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    parser.add_argument("--model", default=store.DEFAULT_MODEL,
                        help="store name (see `sluice models list`) or a converted model folder "
                             "(default: %(default)s)")
    parser.add_argument("--served-model-name", help="name clients use (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int,
                        help="context length in tokens (default: the model's, capped at 8192)")
    parser.add_argument("--block-size", type=int, default=defaults["block_size"],
                        help="tokens per KV-cache block (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=float, default=defaults["kv_cache_gib"],
                        help="KV-cache memory budget in GiB (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"],
                        help="most sequences per step (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults["max_num_batched_tokens"],
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--dtype", default=defaults["dtype"],
                        choices=("float32", "bfloat16", "float16"),
                        help="weights and activations dtype (default: %(default)s)")
    parser.add_argument("--device", default=defaults["device"],
                        help="cpu or cuda (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT. Returns 1 when the model is missing or fails to load."""
    try:
        path = store.resolve(args.model)
        served = args.served_model_name or path.name
        engine_config = EngineConfig(model=str(path), served_model_name=served,
                                     **{k: getattr(args, k) for k in _ENGINE_FLAGS})
    except (store.ModelStoreError, ValueError) as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 1
    worker = Worker(lambda: _load_engine(engine_config), served, root=str(path))
    log_level = str(getattr(args, "log_level", "info")).lower()
    server_config = uvicorn.Config(create_app(worker), host=args.host, port=args.port,
                                   log_level=log_level, timeout_graceful_shutdown=None)
    server = WorkerServer(server_config, worker)
    worker.on_load_failed = server.stop
    server.run()
    return 1 if worker.load_error is not None or not server.started else 0


def _load_engine(config: EngineConfig) -> Engine:
    from sluice.worker.engine.async_engine import AsyncEngine  # torch: only when serving

    return AsyncEngine(config)


class WorkerServer(uvicorn.Server):
    """uvicorn that leaves readiness (``/health`` 503) as soon as SIGTERM/SIGINT arrives."""

    def __init__(self, config: Any, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.draining = True
        super().handle_exit(sig, frame)

    def stop(self) -> None:
        self.should_exit = True


# --------------------------------------------------------------------------- state


class Worker:
    """What the routes share: the engine once loaded, metrics, lifecycle flags.

    Attributes:
        served_model_name: the only model name requests may name.
        root: the model folder (shown in /v1/models).
        engine: None until loaded.
        load_error: the exception that stopped loading, if any.
        draining: SIGTERM seen; /health answers 503 while in-flight requests finish.
        on_load_failed: called (from the loader thread) when loading fails.
    """

    def __init__(self, load_engine: Callable[[], Engine], served_model_name: str, root: str = ""):
        self._load_engine = load_engine
        self.served_model_name = served_model_name
        self.root = root
        self.engine: Engine | None = None
        self.texts: oa.TokenTexts | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.on_load_failed: Callable[[], None] = lambda: None
        self.metrics = WorkerMetrics(served_model_name, self._stats)

    def start_loading(self) -> threading.Thread:
        """Load the engine on a daemon thread (the event loop keeps serving /health)."""
        thread = threading.Thread(target=self._load, name="engine-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        started = time.monotonic()
        try:
            engine = self._load_engine()
        except BaseException as exc:  # noqa: BLE001 - reported, then the process exits 1
            logger.exception("the model failed to load; stopping the worker")
            self.load_error = exc
            self.on_load_failed()
            return
        try:
            asyncio.run(_warm_up(engine))
        except Exception:  # noqa: BLE001 - a failed warm-up only costs the first request time
            logger.warning("warm-up generation failed; serving anyway", exc_info=True)
        self.texts = oa.TokenTexts(engine.tokenizer)
        self.engine = engine  # last: readiness flips here
        logger.info("model %s ready in %.1f s (max_model_len=%d)", self.served_model_name,
                    time.monotonic() - started, engine.max_model_len)

    def require_engine(self, model: str | None = None) -> Engine:
        """The loaded engine, checking the requested model name.

        Raises:
            APIError: 503 while loading; 404 ``model_not_found`` for another model name.
        """
        if self.engine is None:
            raise oa.APIError(503, "the model is still loading; retry shortly",
                              code="model_loading", type="service_unavailable_error")
        if model is not None and model != self.served_model_name:
            raise oa.APIError(404, f"model {model!r} does not exist; this worker serves "
                                   f"{self.served_model_name!r}", param="model",
                              code="model_not_found")
        return self.engine

    def _stats(self) -> Any:
        return self.engine.stats() if self.engine is not None else None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


async def _warm_up(engine: Engine) -> None:
    """Generate a few tokens before readiness: the first forward passes of a fresh process
    are several times slower (lazy allocation, kernel selection), and a router would send
    real traffic into that."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    async for _ in engine.generate(engine.tokenizer.encode("Hello, world"), params, "warm-up"):
        pass


# --------------------------------------------------------------------------- metrics


class WorkerMetrics:
    """Prometheus metrics of one worker, in a registry of its own (vLLM names).

    Latency histograms and token counters are fed per engine request by ``track``; the load
    gauges (running, waiting, KV usage) are read from ``engine.stats()`` at scrape time.
    """

    def __init__(self, model_name: str, stats: Callable[[], Any]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]
        reg = self.registry
        self.ttft = Histogram(names.TTFT, "Time to first token, seconds.", label,
                              buckets=names.TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram(names.ITL, "Time between output tokens, seconds.", label,
                             buckets=names.ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram(names.E2E, "Request latency, arrival to last token, seconds.",
                             label, buckets=names.E2E_BUCKETS, registry=reg).labels(model_name)
        self.prompt_tokens = Counter(names.PROMPT_TOKENS, "Prompt tokens admitted.", label,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter(names.GENERATION_TOKENS, "Output tokens generated.",
                                         label, registry=reg).labels(model_name)
        self.success = Counter(names.REQUEST_SUCCESS, "Engine requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=reg)
        reg.register(_LoadCollector(model_name, stats))

    def track(self, arrival: float, num_prompt_tokens: int) -> RequestTimer:
        """Start timing one engine request that arrived at ``arrival`` (time.monotonic())."""
        self.prompt_tokens.inc(num_prompt_tokens)
        return RequestTimer(self, arrival)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)


class _LoadCollector:
    """Load gauges computed from the engine's stats at scrape time (0 before loading)."""

    def __init__(self, model_name: str, stats: Callable[[], Any]):
        self.model_name = model_name
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, doc, value in (
            (names.NUM_RUNNING, "Requests in the running batch.", s.num_running if s else 0),
            (names.NUM_WAITING, "Requests waiting for admission.", s.num_waiting if s else 0),
            (names.KV_CACHE_USAGE, "Used fraction of the KV-cache blocks, 0..1.",
             s.kv_cache_usage if s else 0.0),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model_name], float(value))
            yield family


class RequestTimer:
    """Records one engine request's TTFT, ITL, E2E and outcome from its deltas.

    TTFT = first output token - arrival; a later delta of k tokens after a gap g adds k ITL
    samples of g/k; E2E at finish. A request closed before finishing counts as "abort".
    """

    def __init__(self, metrics: WorkerMetrics, arrival: float):
        self.m = metrics
        self.arrival = arrival
        self.last_token_at: float | None = None
        self.finished = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        k = len(out.new_token_ids)
        if k:
            if self.last_token_at is None:
                self.m.ttft.observe(now - self.arrival)
            else:
                gap = (now - self.last_token_at) / k
                for _ in range(k):
                    self.m.itl.observe(gap)
            self.last_token_at = now
            self.m.generation_tokens.inc(k)
        if out.finished:
            self.finished = True
            self.m.e2e.observe(now - self.arrival)
            self.m.success.labels(self.m.model_name, out.finish_reason or "abort").inc()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.m.success.labels(self.m.model_name, "abort").inc()


# --------------------------------------------------------------------------- preparation


@dataclasses.dataclass
class Choice:
    """One engine request of a response and how to show it."""

    view: oa.ChoiceView
    params: SamplingParams


def _sampling_params(req: oa.CompletionRequest | oa.ChatCompletionRequest, max_tokens: int,
                     number: int, logprobs: int | None, prompt_logprobs: int | None
                     ) -> SamplingParams:
    """Engine parameters for choice ``number`` (0..n-1) of a prompt.

    With a seed, choice j uses seed + j so the n samples differ but stay reproducible.
    """
    seed = req.seed if req.seed is None or number == 0 else (req.seed + number) % 2**63
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        seed=seed,
        stop=req.stop_strings(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _tokenize_prompts(tokenizer: Any, prompt: Any) -> list[tuple[list[int], str | None]]:
    """A completions ``prompt`` as (token ids, text or None) per prompt.

    Raises:
        APIError: 400 (param ``prompt``) for an empty list.
    """
    if isinstance(prompt, str):
        return [(tokenizer.encode(prompt), prompt)]
    if not prompt:
        raise oa.APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]
    if isinstance(prompt[0], str):
        return [(tokenizer.encode(p), p) for p in prompt]
    return [(list(p), None) for p in prompt]


def _chat_prompt(tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True
                 ) -> tuple[list[int], str]:
    """Render ``messages`` with the tokenizer's chat template; return (token ids, text).

    Raises:
        APIError: 400 (param ``messages``) when the template rejects the messages.
    """
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # jinja raise_exception, missing template, ...
        raise oa.APIError(400, f"the chat template rejected the messages: {exc}",
                          param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False), text


async def _completion_choices(engine: Engine, req: oa.CompletionRequest) -> list[Choice]:
    """Tokenize and validate a completions request into one Choice per prompt and n.

    Raises:
        APIError: 400 for an empty or over-long prompt, bad token ids, or bad max_tokens.
    """
    prompts = await asyncio.to_thread(_tokenize_prompts, engine.tokenizer, req.prompt)
    requested, param = req.requested_max_tokens()
    vocab = len(engine.tokenizer)
    plans = []
    for ids, _ in prompts:
        oa.check_prompt(ids, vocab, engine.max_model_len, "prompt")
        plans.append(oa.max_tokens_for(requested, param, len(ids), engine.max_model_len,
                                       allow_zero=bool(req.echo)))
    n = req.n or 1
    choices = []
    for p, ((ids, text), max_tokens) in enumerate(zip(prompts, plans)):
        if req.echo and text is None:
            text = engine.tokenizer.decode(ids)
        for j in range(n):
            view = oa.ChoiceView(index=p * n + j, prompt_ids=ids, prompt_text=text or "",
                                 count_prompt=j == 0, echo=bool(req.echo),
                                 show_output=max_tokens > 0)
            params = _sampling_params(req, max(max_tokens, 1), j, req.logprobs,
                                      req.logprobs if req.echo else None)
            choices.append(Choice(view, params))
    return choices


async def _chat_choices(engine: Engine, req: oa.ChatCompletionRequest) -> list[Choice]:
    """Render, tokenize and validate a chat request into ``n`` Choices.

    Raises:
        APIError: 400 for bad messages, an over-long prompt, bad max_tokens or top_logprobs
            without logprobs.
    """
    if req.top_logprobs is not None and not req.logprobs:
        raise oa.APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    messages = req.template_messages()
    ids, _ = await asyncio.to_thread(_chat_prompt, engine.tokenizer, messages)
    oa.check_prompt(ids, len(engine.tokenizer), engine.max_model_len, "messages")
    requested, param = req.requested_max_tokens()
    max_tokens = oa.max_tokens_for(requested, param, len(ids), engine.max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return [Choice(oa.ChoiceView(index=j, prompt_ids=ids, count_prompt=j == 0),
                   _sampling_params(req, max_tokens, j, logprobs, None))
            for j in range(req.n or 1)]


def _engine_check(engine: Engine, choices: list[Choice]) -> None:
    """Let the engine veto requests it could never run (e.g. more KV than its whole pool).

    Raises:
        APIError: 400 (param ``max_tokens``) with the engine's reason.
    """
    for choice in choices:
        try:
            engine.check_request(choice.view.prompt_ids, choice.params)
        except ValueError as exc:
            raise oa.APIError(400, str(exc), param="max_tokens") from None


# --------------------------------------------------------------------------- generation


async def _pump(engine: Engine, choice: Choice, request_id: str, timer: RequestTimer,
                queue: asyncio.Queue) -> None:
    """Feed one engine request's deltas into ``queue`` as (index, output), then (index, None).

    An engine error is put on the queue as the exception. Cancelling the task leaves the
    engine's generator, which aborts the request and frees its KV blocks.
    """
    index = choice.view.index
    try:
        stream = engine.generate(choice.view.prompt_ids, choice.params, request_id)
        async with aclosing(stream) as outputs:
            async for out in outputs:
                timer.observe(out)
                queue.put_nowait((index, out))
        queue.put_nowait((index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the consumer
        queue.put_nowait(exc)
    finally:
        timer.close()


async def _outputs(worker: Worker, engine: Engine, choices: list[Choice], response_id: str,
                   arrival: float) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Run every choice as its own engine request; yield (choice index, delta) as they come.

    Raises:
        Exception: the first engine error (the other requests are aborted).
    """
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [
        asyncio.create_task(_pump(engine, c, f"{response_id}-{c.view.index}",
                                  worker.metrics.track(arrival, len(c.view.prompt_ids)), queue))
        for c in choices
    ]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            index, out = item
            if out is None:
                pending -= 1
            else:
                yield index, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(outputs: AsyncIterator[tuple[int, RequestOutput]], shaper: oa.Shaper) -> dict:
    async with aclosing(outputs) as stream:
        async for index, out in stream:
            shaper.on_output(index, out)
    return shaper.response()


async def _sse(outputs: AsyncIterator[tuple[int, RequestOutput]], shaper: oa.Shaper,
               include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: chunks, the usage chunk if asked, then [DONE].

    An engine error becomes an SSE error event followed by [DONE].
    """
    async with aclosing(outputs) as stream:
        try:
            for chunk in shaper.first_chunks():
                yield oa.sse(chunk)
            async for index, out in stream:
                chunk = shaper.on_output(index, out)
                if chunk is not None:
                    yield oa.sse(chunk)
            if include_usage:
                yield oa.sse(shaper.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - reported in-band: headers are sent
            logger.exception("generation failed inside stream %s", shaper.response_id)
            yield oa.sse(oa.error_body(f"generation failed: {exc}", "server_error",
                                       code="engine_error"))
    yield oa.SSE_DONE


class _ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body generator when the response ends.

    Starlette cancels the send loop when the client disconnects but leaves the generator
    suspended; closing it here aborts the engine requests at once instead of at GC.
    """

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any) -> Any:
    """Await ``work`` (a coroutine), cancelling it if the client disconnects first.

    Raises:
        ClientGone: the client went away (the work was cancelled).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _generate(request: Request, worker: Worker, engine: Engine, choices: list[Choice],
                    shaper: oa.Shaper, arrival: float, stream: bool, include_usage: bool
                    ) -> Response:
    """Run validated choices and answer as SSE or as one JSON response.

    Args:
        arrival: when the request arrived (time.monotonic()), the start of TTFT and E2E.
    """
    _engine_check(engine, choices)
    outputs = _outputs(worker, engine, choices, shaper.response_id, arrival)
    headers = _load_headers(engine)
    if stream:
        return _ClosingStreamingResponse(_sse(outputs, shaper, include_usage),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
    try:
        body = await _unless_disconnected(request, _collect(outputs, shaper))
    except ClientGone:
        logger.info("client left; aborted %s", shaper.response_id)
        return Response(status_code=499)
    except Exception as exc:  # noqa: BLE001 - an engine failure, not the client's fault
        logger.exception("generation failed for %s", shaper.response_id)
        raise oa.APIError(500, f"generation failed: {exc}", code="engine_error") from None
    return JSONResponse(body, headers=headers)


def _load_headers(engine: Engine) -> dict[str, str]:
    """Cheap load report for the router on every generation response."""
    s = engine.stats()
    return {"x-sluice-num-running": str(s.num_running),
            "x-sluice-num-waiting": str(s.num_waiting),
            "x-sluice-kv-cache-usage": f"{s.kv_cache_usage:.4f}"}


# --------------------------------------------------------------------------- app


def create_app(worker: Worker) -> FastAPI:
    """The worker's FastAPI app; its lifespan starts loading ``worker``'s engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start_loading()
        yield
        await asyncio.to_thread(worker.shutdown)

    app = FastAPI(title="sluice worker", lifespan=lifespan)
    app.state.worker = worker
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        if worker.load_error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if worker.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(worker.metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        engine = worker.require_engine()
        return oa.model_list(worker.served_model_name, engine.max_model_len, worker.root)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = oa.parse(oa.CompletionRequest, await _json(request))
        engine = worker.require_engine(req.model)
        choices = await _completion_choices(engine, req)
        shaper = oa.CompletionShaper(oa.new_id("cmpl"), worker.served_model_name,
                                     [c.view for c in choices], worker.texts, req.logprobs)
        return await _generate(request, worker, engine, choices, shaper, arrival,
                               bool(req.stream), req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = oa.parse(oa.ChatCompletionRequest, await _json(request))
        engine = worker.require_engine(req.model)
        choices = await _chat_choices(engine, req)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        shaper = oa.ChatShaper(oa.new_id("chatcmpl"), worker.served_model_name,
                               [c.view for c in choices], worker.texts, num_top)
        return await _generate(request, worker, engine, choices, shaper, arrival,
                               bool(req.stream), req.include_usage)

    _add_tokenizer_routes(app, worker)
    return app


def _add_tokenizer_routes(app: FastAPI, worker: Worker) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = oa.parse(oa.TokenizeRequest, await _json(request))
        engine = worker.require_engine(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise oa.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            messages = oa.template_messages(req.messages)
            ids, _ = await asyncio.to_thread(_chat_prompt, engine.tokenizer, messages,
                                             req.add_generation_prompt is not False)
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens is not False)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = oa.parse(oa.DetokenizeRequest, await _json(request))
        engine = worker.require_engine(req.model)
        vocab = len(engine.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise oa.APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(engine.tokenizer.decode, req.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        engine = worker.require_engine()
        tok = engine.tokenizer
        return {"tokenizer_class": type(tok).__name__, "vocab_size": len(tok),
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "max_model_len": engine.max_model_len,
                "chat_template": getattr(tok, "chat_template", None)}


async def _json(request: Request) -> Any:
    """The request body as JSON. Raises APIError (400) when it is not valid JSON."""
    body = await request.body()
    try:
        return json.loads(body)
    except ValueError as exc:
        raise oa.APIError(400, f"request body is not valid JSON: {exc}",
                          code="json_invalid") from None


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error body."""

    @app.exception_handler(oa.APIError)
    async def api_error(_: Request, exc: oa.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = oa.validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(oa.error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(oa.error_body(f"internal error: {exc}", "server_error"),
                            status_code=500)


__all__ = ["Worker", "WorkerMetrics", "WorkerServer", "add_arguments", "create_app", "run"]
