"""`sluice worker`: one model served over the OpenAI HTTP API (FastAPI + uvicorn).

uvicorn starts at once and the engine loads on a background thread: ``/health`` answers 503
until the model is ready, 200 after, and 503 again once SIGTERM starts the graceful drain
(in-flight requests finish, then the engine shuts down), or once ``/drain`` is called. It
also answers 503 while the engine loop is dead or stalled (``sluice.worker.health``), as
does ``/livez``, the liveness probe, which is 200 otherwise (loading and draining included).

Routes: POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models,
/health, /livez, /metrics (Prometheus, vLLM names), /tokenizer_info; POST|GET|DELETE /drain
(the operator's scale-down and the pod's preStop hook: leave readiness first, finish what
runs). A request body over ``--max-body-bytes`` is refused while it is read (413).

This module holds the CLI, the Worker's lifecycle, the app factory and its routes. A route
parses the body (sluice.api.openai models; every client error is a 4xx OpenAI error body,
raised before a stream starts), then hands over to sluice.worker.generation, which tokenizes,
runs one engine request per choice and shapes the answer; sluice.worker.metrics holds the
Prometheus metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sluice.api import openai as oa
from sluice.worker import shaping
from sluice.api.body import MAX_BODY_BYTES, BodyTooLarge, read_body
from sluice.argtypes import nonblank, number, port, positive_count, positive_seconds
from sluice.logs import quiet_probe_access_logs
from sluice.models import store
from sluice.worker.engine.config import QUANTIZATIONS, EngineConfig
from sluice.worker.sampling_params import SamplingParams
from sluice.worker.generation import (Engine, chat_choices, chat_prompt, completion_choices,
                                      generate_response)
from sluice.worker.health import STALL_TIMEOUT_S, EngineWatch
from sluice.worker.metrics import WorkerMetrics

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- CLI

_ENGINE_FLAGS = ("max_model_len", "block_size", "kv_cache_gib", "max_num_seqs",
                 "max_num_batched_tokens", "long_prefill_token_threshold",
                 "enable_prefix_caching", "quantization",
                 "speculative_method", "num_speculative_tokens", "speculative_model_quantization",
                 "max_sequences_per_request", "dtype", "device")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags; engine flags map 1:1 onto EngineConfig (same defaults)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    parser.add_argument("--model", default=store.DEFAULT_MODEL,
                        help="store name (see `sluice models list`) or a converted model folder "
                             "(default: %(default)s)")
    parser.add_argument("--served-model-name", type=nonblank, help="name clients use (default: the folder name)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=port, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--max-model-len", type=positive_count,
                        help="context length in tokens (default: the model's, capped at 8192)")
    parser.add_argument("--block-size", type=positive_count, default=defaults["block_size"],
                        help="tokens per KV-cache block (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=number("GiB", strict=True, maximum=MAX_KV_CACHE_GIB), default=defaults["kv_cache_gib"],
                        help="KV-cache memory budget in GiB (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=positive_count, default=defaults["max_num_seqs"],
                        help="most sequences per step (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=positive_count,
                        default=defaults["max_num_batched_tokens"],
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--long-prefill-token-threshold", type=positive_count,
                        help="most prompt tokens of one request per step at an empty context, "
                             "fewer as its context grows (default: a sixteenth of "
                             "--max-num-batched-tokens)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults["enable_prefix_caching"],
                        help="reuse KV blocks of shared prompt prefixes (default: %(default)s)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="int8: per-channel int8 weight-only linear layers; int4: the "
                        "decoder layers' linears in 4-bit blocks of 32 (llama.cpp's Q4_1; "
                        "lm_head int8) (default: none)")
    parser.add_argument("--speculative-method", choices=("ngram", "draft"),
                        help="ngram: prompt-lookup speculative decoding; draft: a smaller "
                             "model with the same tokenizer, --speculative-model (default: off)")
    parser.add_argument("--speculative-model",
                        help="draft model for --speculative-method draft: store name or folder")
    parser.add_argument("--speculative-quantization", dest="speculative_model_quantization",
                        choices=QUANTIZATIONS,
                        help="int8 or int4 weights for the draft model (default: none)")
    parser.add_argument("--speculative-num-tokens", dest="num_speculative_tokens", type=positive_count,
                        default=defaults["num_speculative_tokens"],
                        help="draft tokens verified per step (default: %(default)s)")
    parser.add_argument("--max-sequences-per-request", type=positive_count,
                        default=defaults["max_sequences_per_request"],
                        help="most engine requests (prompts x n) one API request may fan out "
                             "into; 400 beyond (default: %(default)s)")
    parser.add_argument("--dtype", default=defaults["dtype"],
                        choices=("float32", "bfloat16", "float16"),
                        help="weights and activations dtype (default: %(default)s)")
    parser.add_argument("--device", type=_device, default=defaults["device"],
                        help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="native: Sluice's engine; vllm: vLLM's AsyncLLM, installed by "
                             "`make vllm` in .venv-vllm (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=positive_count, default=MAX_BODY_BYTES,
                        help="largest request body accepted; beyond it: 413, found while "
                             "reading (default: %(default)s)")
    parser.add_argument("--engine-stall-timeout", type=positive_seconds, default=STALL_TIMEOUT_S,
                        help="seconds without engine progress, while it has requests, after "
                             "which /health and /livez answer 503 engine_stalled "
                             "(default: %(default)s)")


MAX_KV_CACHE_GIB = 4096.0  # beyond any accelerator's memory (1e308 overflowed the block count)


def _device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N`` (torch's device strings the engine runs on)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT. Returns 1 when the model is missing or fails to load."""
    engine = getattr(args, "engine", "native")
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        print("sluice worker: vllm is not installed in this environment; "
              "use .venv-vllm/bin/sluice worker --engine vllm", file=sys.stderr)
        return 1
    try:
        path = store.resolve(args.model)
        served = args.served_model_name or path.name
        draft = args.speculative_model and str(store.resolve(args.speculative_model))
        engine_config = EngineConfig(model=str(path), served_model_name=served, speculative_model=draft,
                                     **{k: getattr(args, k) for k in _ENGINE_FLAGS})
        if engine == "native" and engine_config.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"--device {engine_config.device}: torch sees no CUDA device "
                                 f"(torch {torch.__version__}, CUDA build: "
                                 f"{torch.version.cuda or 'no'})")
    except (store.ModelStoreError, ValueError) as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 1
    worker = Worker(lambda: _load_engine(engine_config, engine), served, root=str(path),
                    max_body_bytes=args.max_body_bytes,
                    stall_timeout_s=args.engine_stall_timeout)
    log_level = str(getattr(args, "log_level", "info")).lower()
    server_config = uvicorn.Config(create_app(worker), host=args.host, port=args.port,
                                   log_level=log_level, timeout_graceful_shutdown=None)
    server = WorkerServer(server_config, worker)
    quiet_probe_access_logs()
    worker.on_load_failed = server.stop
    server.run()
    return 1 if worker.load_error is not None or not server.started else 0


def _load_engine(config: EngineConfig, engine: str = "native") -> Engine:
    if engine == "vllm":
        from sluice.worker.vllm_backend import VLLMEngine  # vllm: only in .venv-vllm

        return VLLMEngine(config)
    from sluice.worker.engine.async_engine import AsyncEngine  # torch: only when serving

    return AsyncEngine(config)


class WorkerServer(uvicorn.Server):
    """uvicorn that leaves readiness (``/health`` 503) as soon as SIGTERM/SIGINT arrives."""

    def __init__(self, config: Any, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.draining = self.worker.terminating = True
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
        draining: SIGTERM seen or /drain called; /health answers 503 while in-flight
            requests finish (requests that still arrive are served).
        terminating: SIGTERM seen (a drain that DELETE /drain cannot undo).
        on_load_failed: called (from the loader thread) when loading fails.
        max_body_bytes: the largest request body accepted (413 beyond).
        watch: the engine's liveness and progress (``sluice.worker.health``).
    """

    def __init__(self, load_engine: Callable[[], Engine], served_model_name: str, root: str = "",
                 max_body_bytes: int = MAX_BODY_BYTES,
                 stall_timeout_s: float = STALL_TIMEOUT_S):
        self._load_engine = load_engine
        self.served_model_name = served_model_name
        self.root = root
        self.max_body_bytes = max_body_bytes
        self.watch = EngineWatch(stall_timeout_s)
        self.engine: Engine | None = None
        self.texts: shaping.TokenTexts | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.terminating = False
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
        except ValueError as exc:  # options that do not fit this model or machine: one line
            logger.error("the model failed to load: %s; stopping the worker", exc)
            self.load_error = exc
            self.on_load_failed()
            return
        except BaseException as exc:  # noqa: BLE001 - reported, then the process exits 1
            logger.exception("the model failed to load; stopping the worker")
            self.load_error = exc
            self.on_load_failed()
            return
        try:
            asyncio.run(_warm_up(engine))
        except Exception:  # noqa: BLE001 - a failed warm-up only costs the first request time
            logger.warning("warm-up generation failed; serving anyway", exc_info=True)
        self.texts = shaping.TokenTexts(engine.tokenizer)
        self.engine = engine  # last: readiness flips here
        logger.info("model %s ready in %.1f s (max_model_len=%d)", self.served_model_name,
                    time.monotonic() - started, engine.max_model_len)

    def require_engine(self, model: str | None = None) -> Engine:
        """The loaded engine, checking the requested model name.

        Raises:
            APIError: 503 while loading, or while the engine is dead or stalled (code
                ``engine_dead`` / ``engine_stalled``); 404 ``model_not_found`` for another
                model name.
        """
        if self.engine is None:
            raise oa.APIError(503, "the model is still loading; retry shortly",
                              code="model_loading", type="service_unavailable_error")
        problem = self.engine_problem()
        if problem is not None:
            raise oa.APIError(503, f"this worker cannot serve requests now ({problem}); "
                                   "retry on another worker", code=problem,
                              type="service_unavailable_error")
        if model is not None and model != self.served_model_name:
            raise oa.APIError(404, f"model {model!r} does not exist; this worker serves "
                                   f"{self.served_model_name!r}", param="model",
                              code="model_not_found")
        return self.engine

    def engine_problem(self) -> str | None:
        """``engine_dead``, ``engine_stalled`` or None (``EngineWatch.problem``)."""
        return self.watch.problem(self.engine)

    def _stats(self) -> Any:
        return self.engine.stats() if self.engine is not None else None

    def busy(self) -> tuple[int, int]:
        """(requests running, requests waiting) in the engine now."""
        stats = self._stats()
        return (int(stats.num_running), int(stats.num_waiting)) if stats is not None else (0, 0)

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


# --------------------------------------------------------------------------- app


def create_app(worker: Worker) -> FastAPI:
    """The worker's FastAPI app; its lifespan starts loading ``worker``'s engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start_loading()
        watch = asyncio.create_task(worker.watch.run(lambda: worker.engine))
        yield
        watch.cancel()
        await asyncio.to_thread(worker.shutdown)

    app = FastAPI(title="sluice worker", lifespan=lifespan)
    app.state.worker = worker
    _install_error_handlers(app, worker)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Readiness: 200 ``ok``; 503 ``failed``, ``engine_dead``, ``engine_stalled``,
        ``draining`` or ``loading`` (the router ejects a worker for any but ``draining``)."""
        if worker.load_error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        problem = worker.engine_problem()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        if worker.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if worker.engine is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/livez")
    async def livez() -> JSONResponse:
        """Liveness (the pod's probe): 503 only for an engine that is dead or stalled (or a
        model that failed to load); 200 while loading and draining."""
        if worker.load_error is not None:
            return JSONResponse({"status": "failed"}, status_code=503)
        problem = worker.engine_problem()
        if problem is not None:
            return JSONResponse({"status": problem}, status_code=503)
        return JSONResponse({"status": "alive"})

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
        req = oa.parse(oa.CompletionRequest, await _json(request, worker.max_body_bytes))
        engine = worker.require_engine(req.model)
        choices = await completion_choices(engine, req)
        shaper = shaping.CompletionShaper(oa.new_id("cmpl"), worker.served_model_name,
                                     [c.view for c in choices], worker.texts, req.logprobs)
        return await generate_response(request, worker.metrics, engine, choices, shaper,
                                       arrival, bool(req.stream), req.include_usage,
                                       worker.watch)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = oa.parse(oa.ChatCompletionRequest, await _json(request, worker.max_body_bytes))
        engine = worker.require_engine(req.model)
        choices = await chat_choices(engine, req)
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        shaper = shaping.ChatShaper(oa.new_id("chatcmpl"), worker.served_model_name,
                               [c.view for c in choices], worker.texts, num_top)
        return await generate_response(request, worker.metrics, engine, choices, shaper,
                                       arrival, bool(req.stream), req.include_usage,
                                       worker.watch)

    _add_tokenizer_routes(app, worker)
    _add_drain_routes(app, worker)
    return app


DRAIN_POLL_S = 0.25


def _add_drain_routes(app: FastAPI, worker: Worker) -> None:
    @app.api_route("/drain", methods=["GET", "POST"])
    async def drain(wait: float = 0.0, min: float = 0.0) -> dict:  # noqa: A002 - query name
        """Leave readiness (/health 503) and keep serving; answer with what is left.

        ``?wait=S``: answer once nothing runs or waits, after at least ``min`` seconds and at
        most S — the pod's preStop hook (a GET: Kubernetes 1.20 hooks are httpGet or exec),
        so SIGTERM comes once the worker is idle. The operator POSTs it without a wait
        before a scale-down and polls it until the worker is idle.
        """
        worker.draining = True
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            running, waiting = worker.busy()
            elapsed = loop.time() - started
            if (running + waiting == 0 and elapsed >= min) or elapsed >= wait:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        return {"status": "draining", "running": running, "waiting": waiting}

    @app.delete("/drain")
    async def undrain() -> JSONResponse:
        """Back into readiness (a scale-down that was called off); not once SIGTERM came."""
        if worker.terminating:
            return JSONResponse(oa.http_error_body(409, "the worker is shutting down"),
                                status_code=409)
        worker.draining = False
        return JSONResponse({"status": "serving"})


def _add_tokenizer_routes(app: FastAPI, worker: Worker) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = oa.parse(oa.TokenizeRequest, await _json(request, worker.max_body_bytes))
        engine = worker.require_engine(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise oa.APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.messages is not None:
            messages = oa.template_messages(req.messages)
            ids, _ = await asyncio.to_thread(chat_prompt, engine.tokenizer, messages,
                                             req.add_generation_prompt is not False)
        else:
            ids = await asyncio.to_thread(engine.tokenizer.encode, req.prompt,
                                          add_special_tokens=req.add_special_tokens is not False)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = oa.parse(oa.DetokenizeRequest, await _json(request, worker.max_body_bytes))
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


async def _json(request: Request, limit: int) -> Any:
    """The request body as JSON, read up to ``limit`` bytes.

    Raises:
        APIError: 400 when it is not valid JSON.
        BodyTooLarge: over ``limit`` bytes (found while reading it).
    """
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise oa.APIError(400, f"request body is not valid JSON: {type(exc).__name__}: {exc}",
                          code="json_invalid") from None
    if _may_hold_surrogates(body):
        _check_unicode(data, "")
    return data


def _may_hold_surrogates(body: bytes) -> bool:
    """Whether ``json.loads(body)`` can hold a lone surrogate: only from a ``\\uD800``-
    ``\\uDFFF`` escape, the bytes ED A0-BF of one in UTF-8 (json decodes with surrogatepass:
    ED also leads Hangul, so those bodies are walked too), or a UTF-16/32 body. Other
    bodies skip ``_check_unicode``'s walk, which took 0.8 s of the event loop over a 10 MB
    body of 600k items."""
    return (not json.detect_encoding(body).startswith("utf-8")
            or b"\\ud" in body or b"\\uD" in body or b"\xed" in body)


def _check_unicode(value: Any, path: str) -> None:
    """Raise APIError (400, naming the field) for a string no tokenizer can take: JSON
    allows lone UTF-16 surrogates such as "\\ud800", which are not Unicode text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise oa.APIError(400, f"{path or 'body'} contains a lone UTF-16 surrogate, which "
                              "is not valid Unicode text", param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{path}[{i}]")


def _install_error_handlers(app: FastAPI, worker: Worker) -> None:
    """Every error leaves as an OpenAI error body."""

    @app.exception_handler(oa.APIError)
    async def api_error(_: Request, exc: oa.APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, exc: BodyTooLarge) -> JSONResponse:
        error = oa.APIError(413, f"the request body is larger than {worker.max_body_bytes} "
                                 "bytes (the worker's --max-body-bytes)",
                            code="request_too_large")
        # the rest of the body is not read: the connection cannot carry another request
        return JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})

    @app.exception_handler(ClientDisconnect)
    async def client_left(_: Request, exc: ClientDisconnect) -> Response:
        return Response(status_code=499)  # it left while sending its body: nobody reads this

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = oa.validation_error(exc.errors())
        return JSONResponse(error.body(), status_code=error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(oa.http_error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code, headers=exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(oa.error_body(f"internal error: {exc}", "server_error"),
                            status_code=500)


__all__ = ["Worker", "WorkerServer", "add_arguments", "create_app", "run"]
