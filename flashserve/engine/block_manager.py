"""The KV cache's bookkeeping: which fixed-size blocks of the pool each sequence holds.

Pure Python, no tensors. A block is an index into the per-layer K/V pools; a sequence's
``block_table`` lists its blocks in token order, so token ``i`` lives in slot
``i % block_size`` of block ``block_table[i // block_size]``. Blocks carry reference counts so
that several sequences can share a full block (a common prefix); a block returns to the free
list when its count drops to zero.
"""

from __future__ import annotations

from collections import Counter, deque

from flashserve.engine.sequence import Sequence


class BlockError(AssertionError):
    """The block bookkeeping was misused (double free, foreign block): a bug, never ignored.

    An ``AssertionError`` in spirit, raised explicitly so that ``python -O`` keeps the check.
    """


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise BlockError(message)


class BlockManager:
    """A free list of KV blocks plus a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")  # fmt: skip
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # FIFO: a freed block goes to the back, so recently freed blocks are reused last
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of the pool's blocks in use (0.0 to 1.0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0: free)."""
        return self._ref_counts[block_id]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold its computed tokens plus ``num_new_tokens``."""
        return self.blocks_to_hold(seq, seq.num_computed_tokens + num_new_tokens)

    def blocks_to_hold(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must gain for its table to hold ``num_tokens`` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more tokens than it has computed."""
        self.grow(seq, seq.num_computed_tokens + num_new_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens."""
        needed = self.blocks_to_hold(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(f"out of KV blocks: {seq} needs {needed}, {len(self._free)} free")
        for _ in range(needed):
            block_id = self._free.popleft()
            _check(self._ref_counts[block_id] == 0, f"free block {block_id} is in use")
            self._ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append blocks already in use to ``seq.block_table`` (prefix sharing), counting refs.

        Only full blocks whose tokens equal ``seq``'s tokens at those positions may be shared;
        the caller guarantees that and sets ``seq.num_computed_tokens`` to match.
        """
        for block_id in block_ids:
            _check(0 <= block_id < self.num_blocks, f"block {block_id} is not in the pool")
            _check(self._ref_counts[block_id] > 0, f"cannot share free block {block_id}")
            self._ref_counts[block_id] += 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and clear its block table.

        Raises ``BlockError`` if ``seq`` holds no blocks (a second free) or one of its blocks is
        already free: the pool is never silently corrupted.
        """
        _check(bool(seq.block_table), f"{seq} holds no blocks: freed twice?")
        for block_id, count in Counter(seq.block_table).items():
            _check(0 <= block_id < self.num_blocks, f"block {block_id} is not in the pool")
            _check(self._ref_counts[block_id] >= count, f"{seq}: block {block_id} is already free")
        # tail blocks first: a prompt's head blocks are reused last (useful to prefix caching)
        for block_id in reversed(seq.block_table):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        seq.block_table.clear()
