"""Asyncio front of the engine: one background thread runs ``LLMEngine.step()``.

The event loop never computes: ``generate`` enqueues a request and awaits its deltas; the
engine thread steps while there is work and pushes each RequestOutput to the request's
asyncio queue with ``call_soon_threadsafe``. Leaving ``generate`` early (client gone, task
cancelled) aborts the request, which leaves the batch at the start of the next step and
frees its KV blocks.

One request's failure stays its own: a request the engine fails inside a step (its
sampling, verification or detokenization raised: ``finish_reason`` "error") or cannot add
raises in its own ``generate`` only; only a failure of a whole step (the forward pass)
fails every live request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.llm_engine import LLMEngine
from sluice.worker.outputs import RequestOutput
from sluice.worker.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """A snapshot of engine load, cheap to take from any thread.

    Attributes:
        num_running: sequences in the running batch.
        num_waiting: sequences queued for admission (including preempted ones).
        num_free_blocks: KV blocks in the free pool.
        num_total_blocks: KV blocks in the pool.
        kv_cache_usage: used fraction of the pool, 0..1.
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative).
        prefix_cache_hits: of those, tokens found cached (cumulative).
        spec_draft_tokens: speculative tokens proposed (cumulative).
        spec_accepted_tokens: of those, accepted by the target model (cumulative).
        num_computed_tokens: tokens through the model, prefill chunks and decodes
            (cumulative): the engine's progress, which ``sluice.worker.health`` watches.
    """

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    num_computed_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


class AsyncEngine:
    """Runs an LLMEngine on a background thread and serves it to asyncio code.

    Construction loads the model (seconds); call it off the event loop.

    Attributes:
        tokenizer: the model's HF tokenizer.
        max_model_len: context length in tokens.
        model_name: the served model name.
        max_sequences_per_request: the most engine requests (prompts × n) one API request
            may fan out into (``EngineConfig``); the server refuses more with a 400.
    """

    def __init__(self, config: EngineConfig):
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_name = self.engine.model_name
        self.max_sequences_per_request = config.max_sequences_per_request
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._pending_adds: list[tuple[str, list[int], SamplingParams, str | None]] = []
        self._pending_aborts: list[str] = []
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-step", daemon=True)
        self._thread.start()

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its deltas until it finishes.

        Args:
            prompt_token_ids: the prompt, already tokenized and validated by the caller
                (non-empty; prompt + max_tokens within ``max_model_len``).
            params: sampling parameters.
            request_id: unique among live requests.
            group: the API request it is part of (its prompts × n share one), so the
                scheduler can share the batch fairly between API requests; default: its id.

        Raises:
            ValueError: the request can never run (``LLMEngine.check_request``: empty prompt,
                over the context, bigger than the KV pool) or its id is already live; raised
                before the first output, so a server can still answer 400.
            RuntimeError: the engine failed this request, or a whole step (the message
                carries the error).
        """
        self.check_request(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already running")
            self._queues[request_id] = (loop, queue)
            self._pending_adds.append((request_id, list(prompt_token_ids), params, group))
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise RuntimeError(f"engine failed: {item!r}") from item
                finished = item.finished
                if item.finish_reason == "error":
                    raise RuntimeError(f"engine failed this request: {item.error}")
                yield item
        finally:
            if not finished:
                self.abort(request_id)
            with self._lock:
                self._queues.pop(request_id, None)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError if the engine could never run this request
        (``LLMEngine.check_request``); cheap, so a server can answer 400 before streaming."""
        self.engine.check_request(prompt_token_ids, params)

    def abort(self, request_id: str) -> None:
        """Abort a live request (no-op if it already finished). Thread-safe."""
        with self._lock:
            self._pending_aborts.append(request_id)
        self._wakeup.set()

    def stats(self) -> EngineStats:
        """Current load; safe to call from any thread (reads plain ints)."""
        s = self.engine.scheduler
        pool = s.block_manager
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(self._pending_adds),
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_blocks,
            prefix_cache_queries=pool.prefix_cache_queries,
            prefix_cache_hits=pool.prefix_cache_hits,
            spec_draft_tokens=self.engine.num_draft_tokens,
            spec_accepted_tokens=self.engine.num_accepted_tokens,
            num_computed_tokens=self.engine.scheduler.num_computed_tokens_total,
        )

    def alive(self) -> bool:
        """Whether the engine's step thread still runs (it dies only on a bug: an error in
        the step fails the requests in flight and the loop goes on)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the engine thread (live requests get no more output)."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
            # adds first: a client that left while its request waited to be added (both in
            # one batch) must find it in the engine, or it would run to max_tokens unowned
            for request_id, prompt, params, group in adds:
                try:
                    self.engine.add_request(request_id, prompt, params, group)
                except Exception as exc:  # noqa: BLE001 - this request's alone
                    logger.exception("request %s could not be added", request_id)
                    self._deliver_error(request_id, exc)
            for request_id in aborts:
                try:
                    self._deliver_all(self.engine.abort_request(request_id))
                except Exception:  # noqa: BLE001 - its client has gone already
                    logger.exception("aborting %s failed", request_id)
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as exc:  # surface to every waiter, then keep serving
                logger.exception("engine step failed; failing all live requests")
                self._fail_all(exc)
                continue
            self._deliver_all(outputs)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._queues.get(o.request_id), o) for o in outputs]
        for target, output in targets:
            if target is not None:
                _put(target, output)

    def _deliver_error(self, request_id: str, exc: BaseException) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            _put(target, exc)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.engine.scheduler.request_ids()):
            self.engine.abort_request(request_id)
        with self._lock:
            targets = list(self._queues.values())
        for target in targets:
            _put(target, exc)


def _put(target: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item: object) -> None:
    """Hand ``item`` to a waiter's queue on its loop; a closed loop has nobody to tell."""
    loop, queue = target
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the waiter's event loop is closed
        pass
