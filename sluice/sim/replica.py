"""One replica: a continuous-batching engine advanced by whole steps on a virtual clock.

It follows the native engine's scheduler (``sluice.worker.engine.scheduler``, vLLM v1's
vocabulary): each sequence has ``ctx`` tokens (prompt + emitted) and ``computed`` tokens in
the KV cache; a step spends a token budget (``max_num_batched_tokens``) closing the gap,
running sequences first (a decode is a gap of one; a prompt runs in chunks of at most
``long_prefill_token_threshold``), then waiting sequences are admitted while the budget,
``max_num_seqs`` and the KV pool allow. When the pool cannot hold the next step, the most
recently admitted sequence is preempted (freed; recomputed from the front of the queue).
A sequence emits a token at the end of every step that leaves its gap at zero.

Prefix cache: the prompt's prefix-block ids (Mooncake ``hash_ids``) resident here are not
prefilled again. An LRU of block ids, bounded by the KV pool (capacity / block tokens), is
touched on a hit and filled when a prompt's prefill completes.

Speed: no per-token or per-step events. While the batch keeps its shape (the same decodes,
the same chunks), k steps are one "macro step" whose duration is closed-form (the KV term
grows linearly, an arithmetic series); it ends at the first change (a prompt's prefill
completes, a sequence finishes, the pool would overflow). An arrival cuts the macro step at
the end of the step in progress (``cut``), as the engine admits at step boundaries.

Simplifications (documented, not hidden): KV usage is counted in tokens (not rounded up to
blocks) and a cached prefix counts against every sequence using it; the scheduler's
fairness preemption between multi-sequence requests and the attention-aware shrinking of
chunks are left out (one sequence per request).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

from sluice.sim.profile import StepModel

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """The engine's scheduling limits (``sluice.worker.engine.config.EngineConfig``).

    Attributes:
        max_num_batched_tokens: tokens per step (prefill + decode).
        max_num_seqs: most sequences in a batch.
        long_prefill_token_threshold: most prompt tokens of one sequence per step
            (the engine's default: max_num_batched_tokens / 16).
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 128


class Seq:
    """One request on a replica (token counts; ``rid`` indexes the simulator's arrays)."""

    __slots__ = ("rid", "ctx", "computed", "left", "blocks", "started")

    def __init__(self, rid: int, prompt: int, output: int, blocks: tuple[int, ...]):
        self.rid = rid
        self.ctx = prompt  # tokens whose KV must be computed before the next token
        self.computed = 0
        self.left = output  # tokens still to emit
        self.blocks = blocks
        self.started = False  # has emitted its first token


class Replica:
    """Args:
        index: the replica's number (its endpoint URL derives from it).
        model: step time and KV capacity.
        limits: scheduling limits.
        block_tokens: tokens per prefix block id of the trace.

    Attributes:
        max_macro_steps: the most steps one macro step may merge (1: step by step, the
            reference the tests compare macro steps with).
        waiting / running: sequences, in queue / admission order.
        kv_used: tokens held in the KV pool by running sequences.
        busy_until: virtual time (s) the current macro step ends; None when idle.
        version: bumped whenever the pending step-end event is replaced (lazy deletion).
    """

    max_macro_steps = 1 << 40

    def __init__(self, index: int, model: StepModel, limits: EngineLimits,
                 block_tokens: int = 512):
        self.index = index
        self.model, self.limits = model, limits
        self.block_tokens = block_tokens
        self.capacity = model.kv_capacity_tokens
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.cache_blocks = max(1, self.capacity // block_tokens)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.kv_used = 0
        self.busy_until: float | None = None
        self.version = 0
        self.prefix_hit_tokens = 0
        self.preemptions = 0
        # the macro step in flight: start (s), steps, fixed ms per step, KV at its first
        # step, KV growth per step, and its batch
        self._t0 = 0.0
        self._k = 0
        self._base_ms = 0.0
        self._kv1 = 0
        self._need = 0
        self._batch: list[tuple[Seq, int, bool]] = []  # (seq, tokens, is a decode)

    # ------------------------------------------------------------------ load, as reported

    @property
    def num_seqs(self) -> int:
        return len(self.waiting) + len(self.running)

    def load(self, now: float) -> tuple[int, int, float, int]:
        """What the worker reports at ``now`` (its /metrics and x-sluice-* headers): running,
        waiting, KV usage (0..1) and prompt tokens without a first token yet, as of the
        last step boundary (steps of the macro step in flight included)."""
        j = self._steps_done(now) if self.busy_until is not None else 0
        queued = sum(s.ctx - s.computed for s in self.waiting if not s.started)
        queued += sum(s.ctx - s.computed for s in self.running if not s.started)
        if j:
            queued -= sum(j * n for s, n, decode in self._batch if not decode and not s.started)
        kv = self.kv_used + j * self._need
        return len(self.running), len(self.waiting), min(1.0, kv / self.capacity), queued

    # ------------------------------------------------------------------ events

    def add(self, seq: Seq, now: float) -> float | None:
        """Queue ``seq``; returns the (new) time of the next step end to schedule, or None
        when the pending one stands."""
        self.waiting.append(seq)
        if self.busy_until is None:
            return self._plan(now)
        if len(self.running) < self.limits.max_num_seqs:
            return self._cut(now)
        return None

    def step_end(self, now: float) -> tuple[list[Seq], list[Seq], float | None]:
        """Apply the macro step that ends now.

        Returns:
            (sequences that emitted their first token, sequences finished, the next step
            end or None when idle).
        """
        k, first, done = self._k, [], []
        self.kv_used += k * self._need
        finished = False
        for seq, n, decode in self._batch:
            if decode:  # computes its last token and emits the next, every step
                seq.computed += k
                seq.ctx += k
                seq.left -= k
            else:
                seq.computed += k * n
                if seq.computed < seq.ctx:
                    continue
                seq.ctx += 1
                seq.left -= 1
                if not seq.started:
                    seq.started = True
                    first.append(seq)
                    self._remember(seq.blocks)
            if seq.left <= 0:
                done.append(seq)
                finished = True
        if finished:
            gone = set(map(id, done))
            self.running = [s for s in self.running if id(s) not in gone]
            self.kv_used -= sum(s.computed for s in done)
        self.busy_until = None
        return first, done, self._plan(now)

    # ------------------------------------------------------------------ scheduling

    def _plan(self, now: float) -> float | None:
        """Schedule the next macro step from ``now``; its end time, or None when idle."""
        limits, running = self.limits, self.running
        preempted = False
        while True:  # decodes first, then prompt chunks in admission order
            batch: list[tuple[Seq, int, bool]] = []
            for seq in running:
                if seq.started and seq.ctx - seq.computed == 1:
                    batch.append((seq, 1, True))
            budget = limits.max_num_batched_tokens - len(batch)
            for seq in running:
                gap = seq.ctx - seq.computed
                if gap > 1 or not seq.started:
                    n = min(gap, budget, limits.long_prefill_token_threshold)
                    if n > 0:
                        batch.append((seq, n, False))
                        budget -= n
            need = limits.max_num_batched_tokens - budget
            if self.kv_used + need <= self.capacity or len(running) <= 1:
                break
            self._preempt()
            preempted = True
        if len(running) == len(batch) and not preempted:  # admit more (as the engine does,
            # not in a step that preempted, nor while a running sequence got no budget)
            while self.waiting and budget > 0 and len(running) < limits.max_num_seqs:
                seq = self.waiting[0]
                hit = self._cached_tokens(seq)
                n = min(seq.ctx - hit, budget, limits.long_prefill_token_threshold)
                if self.kv_used + hit + need + n > self.capacity and running:
                    break
                self.waiting.popleft()
                seq.computed = hit
                self.kv_used += hit
                self.prefix_hit_tokens += hit
                running.append(seq)
                batch.append((seq, n, False))
                budget -= n
                need += n
        if not batch:
            return None
        k = self.capacity  # steps until the batch changes shape
        prefill = decodes = 0
        for seq, n, decode in batch:
            if decode:
                decodes += 1
                k = min(k, seq.left)
            else:
                prefill += n
                k = min(k, (seq.ctx - seq.computed) // n)
        if preempted:  # admission resumes at the next step
            k = 1
        k = max(1, min(k, self.max_macro_steps, (self.capacity - self.kv_used) // need))
        m = self.model
        self._t0, self._k, self._batch, self._need = now, k, batch, need
        self._base_ms = (m.c0_ms + m.prefill_token_ms * prefill + m.prefill_token2_ms * prefill
                         * prefill + m.decode_seq_ms * decodes)
        self._kv1 = self.kv_used + need
        self.busy_until = now + self._duration_ms(k) / 1000.0
        return self.busy_until

    def _duration_ms(self, j: int) -> float:
        """ms taken by the macro step's first ``j`` steps (KV grows by ``_need`` a step)."""
        kv_sum = j * self._kv1 + self._need * j * (j - 1) // 2
        return j * self._base_ms + self.model.kv_token_ms * kv_sum

    def _cut(self, now: float) -> float | None:
        """End the macro step with the step in progress at ``now`` (the engine admits at
        step boundaries); the new end time, or None when unchanged."""
        if self._k <= 1:
            return None
        k = self._steps_done(now) + 1
        if k >= self._k:
            return None
        self._k = k
        self.version += 1
        self.busy_until = self._t0 + self._duration_ms(k) / 1000.0
        return self.busy_until

    def _steps_done(self, now: float) -> int:
        """Steps of the macro step in flight that have ended by ``now`` (0 … k)."""
        elapsed_ms = (now - self._t0) * 1000.0
        lo, hi = 0, self._k  # the largest j with duration(j) ≤ elapsed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._duration_ms(mid) <= elapsed_ms:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _preempt(self) -> None:
        """Free the most recently admitted sequence; it is recomputed from the queue's front."""
        victim = self.running.pop()
        self.kv_used -= victim.computed
        victim.computed = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1

    def _cached_tokens(self, seq: Seq) -> int:
        """Leading tokens whose blocks are resident (at least one token is left to compute);
        the hit blocks become the most recently used."""
        hits = 0
        for h in seq.blocks:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hits += 1
        return min(hits * self.block_tokens, seq.ctx - 1)

    def _remember(self, blocks: tuple[int, ...]) -> None:
        cache = self.cache
        for h in blocks:
            cache[h] = None
            cache.move_to_end(h)
        while len(cache) > self.cache_blocks:
            cache.popitem(last=False)
