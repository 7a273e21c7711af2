"""The KV cache's bookkeeping: which fixed-size blocks of the pool each sequence holds.

Pure Python, no tensors. A block is an index into the per-layer K/V pools; a sequence's
``block_table`` lists its blocks in token order, so token ``i`` lives in slot
``i % block_size`` of block ``block_table[i // block_size]``. Blocks carry reference counts so
that several sequences can share a full block (a common prefix); a block returns to the free
list when its count drops to zero.

When every layer of the model attends over a sliding window of ``W`` tokens (``window``), a
token at position ``p`` reads keys ``p - W + 1 .. p`` only, and a prefill chunk starting at
``s`` reads from ``s - W + 1`` on. So once a sequence has computed ``c`` tokens, no later step
reads a block wholly left of position ``c - W + 1``: ``release`` gives such blocks back to the
pool as the sequence grows, and a sequence holds O(W) blocks however long it gets
(``peak_blocks``). Its table keeps its positional meaning: released entries keep their (now
foreign) ids, valid indices into the pool that no kernel reads, and
``seq.num_released_blocks`` says how many leading entries the sequence no longer owns.
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


def peak_blocks(num_tokens: int, block_size: int, window: int, max_step_tokens: int) -> int:
    """The most blocks a sequence of up to ``num_tokens`` tokens holds at once, when a step
    computes at most ``max_step_tokens`` of its tokens and every layer's window is ``window``
    (0: full attention, so all its blocks).

    With a window ``W``, a step computing ``n`` tokens from position ``s`` holds the blocks of
    positions ``s - W + 1 .. s + n - 1``: at most ``L = W - 1 + n`` consecutive positions, which
    touch at most ``(L + BS - 2) // BS + 1`` blocks (one more than ``L / BS`` when they
    straddle block boundaries). E.g. W = 4096, 2,048-token steps, BS = 16: 385 blocks.
    """
    full = -(-num_tokens // block_size)
    if window <= 0:
        return full
    span = window - 1 + max_step_tokens
    return min(full, (span + block_size - 2) // block_size + 1)


class BlockManager:
    """A free list of KV blocks plus a reference count per block.

    ``window``: the sliding window every layer of the model shares (``ModelConfig.kv_window``),
    0 when some layer attends over the whole context: then nothing is released early.
    """

    def __init__(self, num_blocks: int, block_size: int, window: int = 0):
        if num_blocks < 1 or block_size < 1 or window < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1 and window >= 0, got "
                             f"{num_blocks}, {block_size}, {window}")  # fmt: skip
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
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

    def peak_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """``peak_blocks`` under this pool's block size and window."""
        return peak_blocks(num_tokens, self.block_size, self.window, max_step_tokens)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks ``seq`` must gain to hold its computed tokens plus ``num_new_tokens``."""
        return self.blocks_to_hold(seq, seq.num_computed_tokens + num_new_tokens)

    def blocks_to_hold(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must gain for its table to hold ``num_tokens`` tokens (released
        entries count: they stand for positions the table already covers)."""
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

    def release(self, seq: Sequence) -> int:
        """Give back the blocks of ``seq`` that no later step reads, those wholly left of the
        window of its next token (position ``num_computed_tokens``); how many it gave back.

        Call it once the counters of a step are updated: a step still to run computes a later
        position, so it reads none of them. Nothing happens without a window.
        """
        if not self.window:
            return 0
        first_read = max(0, seq.num_computed_tokens - self.window + 1)
        keep_from = min(first_read // self.block_size, len(seq.block_table))
        start = seq.num_released_blocks
        for block_id in seq.block_table[start:keep_from]:
            self._drop_ref(seq, block_id)
        seq.num_released_blocks = max(start, keep_from)
        return max(0, keep_from - start)

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and clear its block table.

        Raises ``BlockError`` if ``seq`` holds no blocks (a second free) or one of its blocks is
        already free: the pool is never silently corrupted.
        """
        _check(bool(seq.block_table), f"{seq} holds no blocks: freed twice?")
        held = seq.held_blocks
        for block_id, count in Counter(held).items():
            _check(0 <= block_id < self.num_blocks, f"block {block_id} is not in the pool")
            _check(self._ref_counts[block_id] >= count, f"{seq}: block {block_id} is already free")
        # tail blocks first: a prompt's head blocks are reused last (useful to prefix caching)
        for block_id in reversed(held):
            self._drop_ref(seq, block_id)
        seq.block_table.clear()
        seq.num_released_blocks = 0

    def _drop_ref(self, seq: Sequence, block_id: int) -> None:
        _check(self._ref_counts[block_id] > 0, f"{seq}: block {block_id} is already free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            self._free.append(block_id)
