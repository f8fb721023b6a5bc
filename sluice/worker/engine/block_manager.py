"""The KV block pool: fixed-size blocks handed to sequences through their block tables,
with automatic prefix caching (vLLM v1's block pool, nano-vllm's BlockManager).

A full block is identified by a chained hash: ``hash((hash of the previous block, its
tokens))``, so equal hashes mean equal prefixes up to a hash collision, which is ruled out
by comparing the stored tokens on every hit. Blocks are reference-counted; a block whose
count drops to zero goes to the back of the free queue but keeps its K/V and its hash, so a
later request with the same prefix can take it back (a hit) until the pool hands it out
again for new tokens (eviction, least recently freed first)::

    free queue (front = next evicted):  [b4 b9 | b2 b7 b3]
                                          ^ tail blocks of a finished sequence go first
"""

from __future__ import annotations

from collections import OrderedDict

from sluice.worker.engine.sequence import Sequence


class BlockManager:
    """Allocates, caches and frees KV-cache blocks.

    Args:
        num_blocks: blocks in the pool (sized by the model runner from the memory budget).
        block_size: tokens per block.
        enable_prefix_caching: reuse full blocks across requests with the same prefix.

    Invariant (checked by tests): at idle, ``num_free_blocks == num_blocks``.

    Attributes:
        prefix_cache_queries: prompt tokens looked up in the prefix cache (cumulative).
        prefix_cache_hits: of those, tokens found cached (cumulative).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_cnt = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block id -> chained hash (full, cached blocks)
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self._cached: dict[int, int] = {}  # chained hash -> block id
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they can be evicted)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate_prefix(self, seq: Sequence) -> None:
        """For a sequence with no blocks yet: take every cached block of its longest cached
        prefix and mark those tokens computed. At least one token is left to compute, so
        the step still produces logits. Requests that want prompt logprobs skip the cache
        (every prompt position must be computed)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return
        self.prefix_cache_queries += seq.num_tokens
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = self._block_tokens(seq, i)
            h = hash((seq.block_hashes[-1] if seq.block_hashes else None, tokens))
            block = self._cached.get(h)
            if block is None or self._tokens_of[block] != tokens:
                break
            self._take(block)
            seq.block_table.append(block)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        self.prefix_cache_hits += seq.num_computed_tokens

    def cancel_prefix(self, seq: Sequence) -> None:
        """Undo ``allocate_prefix`` for a sequence that is not admitted after all: free its
        blocks, reset its progress and take its lookup back out of the hit counters (it
        will be looked up again when it is admitted)."""
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None:
            self.prefix_cache_queries -= seq.num_tokens
            self.prefix_cache_hits -= seq.num_computed_tokens
        self.free(seq)
        seq.num_computed_tokens = 0

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold its computed tokens plus ``num_new_tokens``.

        Returns False, allocating nothing, when the pool is short: the scheduler's signal
        to preempt (vLLM v1's ``allocate_slots`` returning None).
        """
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self._free):
            return False
        for _ in range(need):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_cnt[block] = 1
            seq.block_table.append(block)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed blocks (all tokens computed) for reuse."""
        if not self.enable_prefix_caching:
            return
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            block, tokens = seq.block_table[i], self._block_tokens(seq, i)
            h = hash((seq.block_hashes[-1] if seq.block_hashes else None, tokens))
            seq.block_hashes.append(h)
            if block not in self._hash_of:
                self._hash_of[block], self._tokens_of[block] = h, tokens
                self._cached.setdefault(h, block)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first, so the tail is evicted first) and clear its
        table. Cached blocks keep their K/V until evicted."""
        for block in reversed(seq.block_table):
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                self._free[block] = None
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_draft_computed = 0

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _take(self, block: int) -> None:
        if self._ref_cnt[block] == 0:
            del self._free[block]
        self._ref_cnt[block] += 1

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            self._tokens_of.pop(block)
            if self._cached.get(h) == block:
                del self._cached[h]
