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

Fairness between requests: sequences carry a ``group`` (the API request they belong to: one
per prompt × n share it). Waiting sequences queue per group (``FairQueue``); admission takes
first a group with nothing running (oldest first), else the next group in round-robin
order, so one request's thousands of sequences cannot hold the queue. A request of several
sequences that shares the engine with other requests is prefilled like one long prompt: per
step, ``long_prefill_token_threshold`` tokens shared equally between the requests that have
work (its first chunk of a step is never cut, so it always progresses), so the steps it
shares with others stay short (each step is every running request's inter-token latency).
Alone, it gets one chunk a step (2,000 prompts x n 8: about 18 prompts a step), so a
newcomer first waits for at most one chunk's step. The price is the lone request's own
speed: a fan-out alone runs 21 % fewer tokens a second than with two chunks a step, and the
n copies of one long prompt (n > 1) prefill one chunk a step between them (sharing the
prompt's KV between siblings, as vLLM does, would remove that). Requests of one sequence
keep their chunk as before.
Round-robin alone
only helps once slots free up; when the batch is full (``max_num_seqs``) or the pool too
short for a waiting group that has nothing running, the most recently admitted sequence of
the group running the most sequences (at least two) is preempted to make room — so a new
request waits at most a step, even behind one request's long generations. Each such
preemption moves a slot from a group with two or more to a group with none, so it cannot
cycle; requests of one sequence each (the usual case) are never preempted for fairness and
keep first-come-first-served order.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from itertools import islice

from sluice.worker.engine.block_manager import BlockManager
from sluice.worker.engine.config import EngineConfig
from sluice.worker.engine.fair_queue import FairQueue
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

    Attributes:
        waiting: sequences not running (new or preempted), per group.
        running: sequences holding KV blocks, in admission order (the last one is the first
            preempted for memory).
        num_preemptions: preemptions so far (memory and fairness).
    """

    def __init__(self, config: EngineConfig, num_blocks: int,
                 attention_break_even: float | None = None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.attention_break_even = attention_break_even
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting = FairQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_computed_tokens_total = 0  # tokens run through the model, all steps
        self._by_id: dict[str, Sequence] = {}  # every unfinished sequence
        self._running_of: Counter[str] = Counter()  # group -> running sequences (no zeros)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence.

        Raises:
            ValueError: its request id is already unfinished here.
        """
        if seq.request_id in self._by_id:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        self._by_id[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    def request_ids(self) -> Iterator[str]:
        yield from list(self._by_id)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """Pick this step's work.

        Returns:
            (sequence, num_new_tokens) pairs in batch order; each sequence's block table
            already has room for its new tokens. Sum of num_new_tokens <= the token budget.
        """
        self._preempt_for_fairness()
        budget = self.max_num_batched_tokens
        # prefill tokens each request (group) may still run this step; a request's first
        # chunk of the step is never cut by it (see _prefill_cap)
        prefill_left: dict[str, int] = {}
        share = self._fan_out_share()
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
                left = prefill_left.get(seq.group)
                n = min(gap, budget - later_decodes, self.chunk_limit(seq),
                        *(() if left is None else (left,)))
                if n <= 0:
                    i += 1
                    continue
            while not self.block_manager.allocate_slots(seq, n):
                victim = self.running[-1]
                self._preempt(victim, resume_first=True)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                if gap > 1:
                    prefill_left[seq.group] = prefill_left.get(
                        seq.group, self._prefill_cap(seq.group, share)) - n
                i += 1
        spent: set[str] = set()  # groups out of prefill tokens this step
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            group = self._next_group(spent)
            if group is None:
                break
            seq = self.waiting.peek(group)
            self.block_manager.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.chunk_limit(seq))
            if n > prefill_left.get(group, n):  # a short prompt is never split for it
                self.block_manager.cancel_prefix(seq)
                spent.add(group)
                continue
            if not self.block_manager.allocate_slots(seq, n):
                self.block_manager.cancel_prefix(seq)
                break
            self.waiting.pop(group)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._running_of[seq.group] += 1
            scheduled.append((seq, n))
            budget -= n
            prefill_left[group] = prefill_left.get(group, self._prefill_cap(group, share)) - n
        return scheduled

    def _fan_out_share(self) -> int:
        """Prefill tokens per step for a request of several sequences: the chunk threshold,
        shared equally between the requests that have work (at least 1), so it runs like one
        long prompt — alone too: on a CPU a step's time grows with its tokens past a chunk
        (a 255-token step took 0.9 s, a 61-token one 0.34 s; bench/fan_out.py), so bigger
        steps alone buy little throughput and make a newcomer wait. O(max_num_seqs)."""
        running_only = sum(1 for g in self._running_of if not self.waiting.has_group(g))
        active = running_only + self.waiting.num_groups
        return max(1, self.long_prefill_token_threshold // max(1, active))

    def _prefill_cap(self, group: str, share: int) -> int:
        """The prefill tokens ``group`` may run in a step: a request of one sequence, its
        chunk (``chunk_limit``, unchanged); a request of several (prompts x n), ``share``.
        Either way its first chunk of a step is never cut (so it always progresses)."""
        if self._running_of[group] + self.waiting.group_size(group) <= 1:
            return self.long_prefill_token_threshold
        return share

    def _next_group(self, spent: set[str]) -> str | None:
        """The group to admit from: the first waiting group with nothing running, else the
        front of the rotation; skipping ``spent`` groups. O(max_num_seqs): at most that many
        groups run something or are spent."""
        group = next((g for g in self._starved_groups() if g not in spent), None)
        if group is None:
            limit = len(spent) + 1
            group = next((g for g in islice(self.waiting.groups(), limit) if g not in spent), None)
        return group

    def _starved_groups(self) -> Iterator[str]:
        """Waiting groups with no running sequence, front of the rotation first. At most
        ``len(self._running_of)`` groups have one running, so a scan of that many plus
        ``max_num_seqs`` finds every starved group this step can admit: O(max_num_seqs)."""
        limit = len(self._running_of) + self.max_num_seqs
        return (g for g in islice(self.waiting.groups(), limit) if g not in self._running_of)

    def _preempt_for_fairness(self) -> None:
        """Make room for waiting groups that have nothing running: while the batch is full
        or the pool cannot hold such a group's first chunk, preempt the latest sequence of
        the group running the most (if it runs two or more)."""
        free_slots = self.max_num_seqs - len(self.running)
        for group in list(islice(self._starved_groups(), self.max_num_seqs)):
            seq = self.waiting.peek(group)
            need = self.block_manager.blocks_for(min(seq.num_tokens, self.chunk_limit(seq)))
            while free_slots <= 0 or self.block_manager.num_free_blocks < need:
                victim = self._fairness_victim()
                if victim is None:
                    return
                logger.debug("preempting %s of %s for %s", victim.request_id, victim.group,
                             group)
                self._preempt(victim, resume_first=False)
                free_slots += 1
            free_slots -= 1

    def _fairness_victim(self) -> Sequence | None:
        """The most recently admitted sequence of the group running the most, if that
        group runs two or more."""
        group, count = max(self._running_of.items(), key=lambda item: item[1],
                           default=(None, 0))
        if count < 2:
            return None
        return next(s for s in reversed(self.running) if s.group == group)

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
        """Mark ``seq`` finished, drop it from the queues and free its blocks at once.
        O(1) for a waiting sequence, O(max_num_seqs) for a running one."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._count_down(seq.group)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._by_id.pop(seq.request_id, None)
        seq.status = status
        self.block_manager.free(seq)

    def find(self, request_id: str) -> Sequence | None:
        """The unfinished sequence with this id, or None (O(1))."""
        return self._by_id.get(request_id)

    def _preempt(self, seq: Sequence, resume_first: bool) -> None:
        logger.debug("preempting %s (%d tokens) for recompute", seq.request_id, seq.num_tokens)
        if self.running[-1] is seq:  # the memory path's victim: O(1)
            self.running.pop()
        else:
            self.running.remove(seq)
        self._count_down(seq.group)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_token_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.push_front(seq, resume_first)
        self.num_preemptions += 1

    def _count_down(self, group: str) -> None:
        self._running_of[group] -= 1
        if not self._running_of[group]:
            del self._running_of[group]
