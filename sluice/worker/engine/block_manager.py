"""The KV block pool: fixed-size blocks handed to sequences through their block tables."""

from __future__ import annotations

from collections import deque

from sluice.worker.engine.sequence import Sequence


class BlockManager:
    """Allocates and frees KV-cache blocks.

    Args:
        num_blocks: blocks in the pool (sized by the model runner from the memory budget).
        block_size: tokens per block.

    Invariant (checked by tests): at idle, ``num_free_blocks == num_blocks``.
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow ``seq.block_table`` to hold its computed tokens plus ``num_new_tokens``.

        Returns False, allocating nothing, when the pool is short: the scheduler's signal
        to preempt (vLLM v1's ``allocate_slots`` returning None).
        """
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self._free):
            return False
        seq.block_table.extend(self._free.popleft() for _ in range(need))
        return True

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the pool (tail first) and clear its table."""
        self._free.extend(reversed(seq.block_table))
        seq.block_table.clear()
