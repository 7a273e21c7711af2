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

Prefix caching (``prefix_caching=True``): once a block is full of computed tokens it gets a
key, a 128-bit BLAKE2b hash of its tokens chained with the key of the block before it, so a
key names the whole prefix up to the block's end. A block whose last holder lets go keeps its
key and contents: it waits, reusable, among the free blocks, and is evicted (its key dropped)
only when the pool hands it out again, least recently freed first and after every free block
without a key. ``match`` finds the longest run of cached blocks at the start of a sequence's
tokens and ``admit`` starts the sequence on them, its ``num_computed_tokens`` past them, so it
computes only the rest (at least its last token, for the logits). A key names one block and a
block carries at most one key: two sequences that compute the same prefix at once each keep
their own copy, and only the first to fill it keys it. With a sliding window, released
blocks keep their keys as well (their contents are still right), and a sequence admitted on
cached blocks holds only those its next token's window reads.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque

from flashserve.engine.sequence import Sequence


class BlockError(AssertionError):
    """The block bookkeeping was misused (double free, foreign block): a bug, never ignored.

    An ``AssertionError`` in spirit, raised explicitly so that ``python -O`` keeps the check.
    """


def _check(ok: bool, message: str, *args: object) -> None:
    """Raise ``BlockError(message.format(*args))`` unless ``ok``: the message is formatted only
    then (these checks run per block, and a sequence's repr costs more than the check)."""
    if not ok:
        raise BlockError(message.format(*args))


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
    ``prefix_caching``: key full blocks and keep them for reuse once free (see the module).
    """

    def __init__(self, num_blocks: int, block_size: int, window: int = 0,
                 prefix_caching: bool = False):  # fmt: skip
        if num_blocks < 1 or block_size < 1 or window < 0:
            raise ValueError(f"need num_blocks >= 1, block_size >= 1 and window >= 0, got "
                             f"{num_blocks}, {block_size}, {window}")  # fmt: skip
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.prefix_caching = prefix_caching
        self._ref_counts = [0] * num_blocks
        # free blocks without a key. FIFO: a freed block goes to the back, reused last
        self._free: deque[int] = deque(range(num_blocks))
        # free blocks with a key, least recently freed first: handed out after _free's
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._key_of: list[bytes | None] = [None] * num_blocks
        self._block_of: dict[bytes, int] = {}  # key -> the one block that carries it

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted when needed)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a key, held or free."""
        return len(self._block_of)

    def usage(self) -> float:
        """Fraction of the pool's blocks in use (0.0 to 1.0); cached free blocks are free."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def key_of(self, block_id: int) -> bytes | None:
        """The key of ``block_id`` (None: it caches nothing)."""
        return self._key_of[block_id]

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
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_new_tokens`` more tokens than it has computed."""
        self.grow(seq, seq.num_computed_tokens + num_new_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens."""
        needed = self.blocks_to_hold(seq, num_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq} needs {needed}, "
                               f"{self.num_free_blocks} free")  # fmt: skip
        for _ in range(needed):
            seq.block_table.append(self._pop_free())

    def _pop_free(self) -> int:
        """A free block for new contents: one without a key, else the least recently freed
        cached one, whose key is dropped (evicted)."""
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._key_of[block_id]]
            self._key_of[block_id] = None
        _check(self._ref_counts[block_id] == 0, "free block {} is in use", block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append blocks already in use to ``seq.block_table`` (prefix sharing), counting refs.

        Only full blocks whose tokens equal ``seq``'s tokens at those positions may be shared;
        the caller guarantees that and sets ``seq.num_computed_tokens`` to match.
        """
        for block_id in block_ids:
            _check(0 <= block_id < self.num_blocks, "block {} is not in the pool", block_id)
            _check(self._ref_counts[block_id] > 0, "cannot share free block {}", block_id)
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
        _check(bool(seq.block_table), "{} holds no blocks: freed twice?", seq)
        held = seq.held_blocks
        for block_id, count in Counter(held).items():
            _check(0 <= block_id < self.num_blocks, "block {} is not in the pool", block_id)
            _check(
                self._ref_counts[block_id] >= count, "{}: block {} is already free", seq, block_id
            )
        # tail blocks first: a prompt's head blocks are reused last (useful to prefix caching)
        for block_id in reversed(held):
            self._drop_ref(seq, block_id)
        seq.block_table.clear()
        seq.num_released_blocks = seq.num_keyed_blocks = 0

    def _drop_ref(self, seq: Sequence, block_id: int) -> None:
        _check(self._ref_counts[block_id] > 0, "{}: block {} is already free", seq, block_id)
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if self._key_of[block_id] is None:
                self._free.append(block_id)
            else:
                self._cached_free[block_id] = None

    # ---- prefix caching ------------------------------------------------------------------

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of ``seq``'s first ``num_blocks`` full blocks of tokens (kept on the
        sequence: tokens in full blocks never change, so each key is hashed once)."""
        keys, bs = seq.block_keys, self.block_size
        if len(keys) < num_blocks:
            ids = seq.token_ids
            for i in range(len(keys), num_blocks):
                h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
                h.update(array("q", ids[i * bs : (i + 1) * bs]).tobytes())
                keys.append(h.digest())
        return keys[:num_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """The cached blocks holding the longest run of full blocks at the start of ``seq``'s
        tokens, leaving at least its last token to compute (its logits are needed)."""
        if not self.prefix_caching:
            return []
        hits = []
        for key in self.keys(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self._block_of.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _first_held(self, num_computed: int) -> int:
        """Index of the first block a sequence with ``num_computed`` tokens computed holds."""
        return max(0, num_computed - self.window + 1) // self.block_size if self.window else 0

    def blocks_to_admit(self, hits: list[int], num_new_tokens: int) -> int:
        """Free blocks that ``admit(seq, hits, num_new_tokens)`` takes: the new ones, plus the
        cached ones nobody holds (they leave the free blocks)."""
        first = self._first_held(len(hits) * self.block_size)
        idle = sum(1 for b in hits[first:] if self._ref_counts[b] == 0)
        total = self.num_blocks_for(len(hits) * self.block_size + num_new_tokens)
        return idle + max(0, total - len(hits))

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Start ``seq`` (holding no blocks) on the cached blocks ``hits`` (from ``match``):
        its table begins with them, its tokens in them count as computed, and it grows to hold
        ``num_new_tokens`` more. With a window, the hits left of its next token's window stay
        in the table as released entries, not held."""
        _check(not seq.block_table, "{} already holds blocks", seq)
        keys = self.keys(seq, len(hits))
        for block_id, key in zip(hits, keys):
            _check(self._key_of[block_id] == key, "block {} is stale: evicted", block_id)
        if self.blocks_to_admit(hits, num_new_tokens) > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: cannot admit {seq}")
        cached = len(hits) * self.block_size
        first = self._first_held(cached)
        for i, block_id in enumerate(hits):
            if i >= first:
                if self._ref_counts[block_id] == 0:
                    del self._cached_free[block_id]
                self._ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_released_blocks = min(first, len(hits))
        seq.num_keyed_blocks = len(hits)
        seq.num_computed_tokens = cached
        self.grow(seq, cached + num_new_tokens)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Key the blocks of ``seq`` that its computed tokens have filled since the last call
        (call it after the counters of a step are updated, before ``release``). A key already
        on another block stays there: this block then caches nothing."""
        if not self.prefix_caching:
            return
        computed = min(seq.num_computed_tokens, seq.num_tokens)  # tokens known and computed
        full = min(computed // self.block_size, len(seq.block_table))
        if full <= seq.num_keyed_blocks:
            return
        keys = self.keys(seq, full)
        for i in range(max(seq.num_keyed_blocks, seq.num_released_blocks), full):
            block_id = seq.block_table[i]
            if keys[i] not in self._block_of and self._key_of[block_id] is None:
                self._key_of[block_id] = keys[i]
                self._block_of[keys[i]] = block_id
        seq.num_keyed_blocks = full

    def check(self) -> None:
        """Raise ``BlockError`` if the pool's own records disagree (for tests): each block is
        held or in exactly one free list (keyed blocks in the cached one), and keys and blocks
        name each other one to one."""
        plain, cached = set(self._free), set(self._cached_free)
        _check(len(plain) == len(self._free) and not plain & cached, "a block is free twice")
        for b in range(self.num_blocks):
            _check((self._ref_counts[b] == 0) == (b in plain or b in cached),
                   "block {}: ref count {} vs the free lists", b, self._ref_counts[b])  # fmt: skip
            _check((b in cached) <= (self._key_of[b] is not None), "block {} has no key", b)
            _check((b in plain) <= (self._key_of[b] is None), "block {} has a key", b)
            key = self._key_of[b]
            _check(key is None or self._block_of.get(key) == b, "block {}: key not mapped", b)
        _check(all(self._key_of[b] == k for k, b in self._block_of.items()), "stale key map")
