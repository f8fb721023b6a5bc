"""Iteration-level scheduler (continuous batching, Orca / vLLM v1 style).

Every step spends a token budget closing the gap between each sequence's computed and
total tokens: running sequences first (a decode is a gap of one; a long prompt gets a
chunk of the budget — chunked prefill), then waiting sequences are admitted while the
budget, ``max_num_seqs`` and the block pool allow. One prefill chunk is at most
``long_prefill_token_threshold`` tokens, so a long prompt never holds the whole budget and
new requests are admitted (and decode) while it is still prefilling.

A chunk's cost grows with the context it attends over: per token, the linear layers cost
a constant and attention one more unit per ``attention_break_even`` tokens of context
(``ModelRunner.attention_break_even``). The threshold is divided by ``1 + computed /
attention_break_even``, so chunks late in a long prompt are smaller and every step takes
about as long (Sarathi-Serve, Agrawal et al. 2024, sizes chunks to a step-time budget).

When the pool cannot give a running sequence its next block, the most recently admitted
sequence is preempted: its blocks are freed and it goes back to the front of the waiting
queue to be recomputed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterator

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides which sequences run in the next step and with how many tokens.

    Args:
        config: engine config (reads max_num_seqs, max_num_batched_tokens,
            long_prefill_token_threshold, block_size, enable_prefix_caching).
        num_blocks: KV blocks in the pool.
        attention_break_even: context length (tokens) at which a prefill token's attention
            costs as much as its linear layers; None: chunks are not shrunk with context.
    """

    def __init__(self, config: EngineConfig, num_blocks: int,
                 attention_break_even: float | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.attention_break_even = attention_break_even
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model, all steps

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def request_ids(self) -> Iterator[str]:
        yield from (s.request_id for s in [*self.running, *self.waiting])

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work.

        Returns:
            (sequence, num_new_tokens) pairs in batch order; each sequence's block table
            already has room for its new tokens. Sum of num_new_tokens <= the token budget.
        """
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            gap = seq.num_tokens - seq.num_computed_tokens
            if gap == 1:  # decode (plus drafts), ahead of any prefill chunk
                n = min(1 + len(seq.spec_token_ids), budget)
                del seq.spec_token_ids[n - 1:]  # drafts that do not fit the budget
            else:  # prefill chunk: leave a token for each later decode in the batch
                later_decodes = sum(1 for s in self.running[i + 1:]
                                    if s.num_tokens - s.num_computed_tokens == 1)
                n = min(gap, budget - later_decodes, self.chunk_limit(seq))
                if n <= 0:
                    i += 1
                    continue
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            self.block_manager.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_limit(seq))
            if not self.block_manager.allocate_slots(seq, n):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def chunk_limit(self, seq: Sequence) -> int:
        """The most prefill tokens ``seq`` may run this step: the threshold, shrunk by the
        attention over its ``num_computed_tokens`` of context (at least 1)."""
        limit = self.long_prefill_token_threshold
        if self.attention_break_even:
            limit /= 1 + seq.num_computed_tokens / self.attention_break_even
        return max(1, int(limit))

    def on_computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After the forward pass: advance each sequence and cache its completed blocks."""
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.num_computed_tokens_total += n
            self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Mark ``seq`` finished, drop it from the queues and free its blocks at once."""
        seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        return next((s for s in [*self.running, *self.waiting] if s.request_id == request_id), None)

    def _preempt(self, seq: Sequence) -> None:
        logger.debug("preempting %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
