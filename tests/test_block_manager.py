"""BlockManager: block tables, reference counts, exhaustion, misuse, and blocks given back as
they fall left of a sliding window."""

from __future__ import annotations

import random

import pytest

from flashserve.engine.block_manager import BlockError, BlockManager, peak_blocks
from flashserve.engine.sequence import Sequence


def _seq(num_tokens: int) -> Sequence:
    return Sequence([random.randrange(1000) for _ in range(num_tokens)])


def _assert_consistent(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Every block is either free or held, and its ref count is its number of holders."""
    holders = [0] * bm.num_blocks
    for s in seqs:
        for b in s.held_blocks:
            holders[b] += 1
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == holders[b], f"block {b}: ref {bm.ref_count(b)} vs {holders[b]}"
    assert bm.num_free_blocks == holders.count(0)


_SIZES = {"1": lambda bs: 1, "bs-1": lambda bs: max(1, bs - 1), "bs": lambda bs: bs,
          "bs+1": lambda bs: bs + 1}  # fmt: skip


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("size", list(_SIZES))
def test_block_table_across_boundaries(block_size: int, size: str) -> None:
    """A prompt of 1, bs-1, bs, bs+1 tokens, then decode token by token across boundaries."""
    n = _SIZES[size](block_size)
    bm = BlockManager(64, block_size)
    seq = _seq(n)
    assert bm.blocks_needed(seq, n) == -(-n // block_size)
    bm.allocate(seq, n)
    assert len(seq.block_table) == -(-n // block_size)
    assert len(set(seq.block_table)) == len(seq.block_table)
    seq.num_computed_tokens = n
    for _ in range(3 * block_size + 1):
        seq.append_token(random.randrange(1000))
        before = len(seq.block_table)
        bm.allocate(seq, 1)
        grew = seq.num_computed_tokens % block_size == 0  # the next token opens a new block
        assert len(seq.block_table) == before + grew, f"at {seq.num_computed_tokens} tokens"
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-seq.num_computed_tokens // block_size)
    _assert_consistent(bm, [seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 64 and bm.usage() == 0.0


def test_blocks_needed_counts_computed_tokens() -> None:
    bm = BlockManager(32, 8)
    seq = _seq(30)
    bm.allocate(seq, 10)  # a first chunk: 2 blocks
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 10
    assert bm.blocks_needed(seq, 6) == 0  # 16 tokens still fit in 2 blocks
    assert bm.blocks_needed(seq, 7) == 1
    assert bm.blocks_needed(seq, 20) == 2
    bm.allocate(seq, 20)
    assert len(seq.block_table) == 4
    assert bm.blocks_needed(seq, 1) == 0


def test_random_round_trips() -> None:
    """Allocate random sequences until the pool is full, free in random order, repeat."""
    bm = BlockManager(random.randint(20, 200), random.choice([1, 2, 8, 16]))
    for _ in range(5):
        held: list[Sequence] = []
        while True:
            seq = _seq(random.randint(1, 5 * bm.block_size))
            if not bm.can_allocate(seq, seq.num_tokens):
                break
            bm.allocate(seq, seq.num_tokens)
            held.append(seq)
            _assert_consistent(bm, held)
        all_blocks = [b for s in held for b in s.block_table]
        assert len(all_blocks) == len(set(all_blocks)), "a block was handed out twice"
        assert bm.usage() == pytest.approx(len(all_blocks) / bm.num_blocks)
        random.shuffle(held)
        while held:
            bm.free(held.pop())
            _assert_consistent(bm, held)
        assert bm.num_free_blocks == bm.num_blocks and bm.usage() == 0.0


def test_exhaustion() -> None:
    bm = BlockManager(5, 4)
    a = _seq(17)  # 5 blocks: the whole pool
    assert bm.can_allocate(a, 17)
    bm.allocate(a, 17)
    assert bm.num_free_blocks == 0 and bm.usage() == 1.0
    b = _seq(1)
    assert not bm.can_allocate(b, 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(b, 1)
    assert b.block_table == [] and bm.num_free_blocks == 0
    assert not bm.can_allocate(_seq(21), 21)  # more than the pool holds in all
    bm.free(a)
    assert bm.can_allocate(b, 1) and bm.usage() == 0.0


def test_ref_counts_with_sharing() -> None:
    bm = BlockManager(16, 4)
    a = _seq(10)  # 3 blocks, the first 2 full
    bm.allocate(a, 10)
    b = _seq(9)
    bm.share(b, a.block_table[:2])
    b.num_computed_tokens = 8
    bm.allocate(b, 1)
    assert [bm.ref_count(x) for x in a.block_table] == [2, 2, 1]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    _assert_consistent(bm, [a, b])
    shared = a.block_table[:2]
    bm.free(a)
    assert [bm.ref_count(x) for x in shared] == [1, 1]  # still held by b
    assert bm.num_free_blocks == 16 - 3
    _assert_consistent(bm, [b])
    bm.free(b)
    assert bm.num_free_blocks == 16 and all(bm.ref_count(x) == 0 for x in range(16))


def test_misuse_is_caught() -> None:
    bm = BlockManager(8, 4)
    a = _seq(6)
    bm.allocate(a, 6)
    table = list(a.block_table)
    bm.free(a)
    with pytest.raises(BlockError, match="freed twice"):
        bm.free(a)
    a.block_table = table  # a stale table: its blocks are free already
    with pytest.raises(BlockError, match="already free"):
        bm.free(a)
    assert bm.num_free_blocks == 8, "a refused free must not change the pool"
    with pytest.raises(BlockError, match="cannot share free block"):
        bm.share(_seq(4), [table[0]])
    b = _seq(4)
    bm.allocate(b, 4)
    b.block_table.append(b.block_table[0])  # the same block twice, ref count 1
    with pytest.raises(BlockError, match="already free"):
        bm.free(b)
    with pytest.raises(BlockError, match="not in the pool"):
        bm.share(_seq(4), [8])
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="window"):
        BlockManager(8, 4, window=-1)


# ---- sliding windows -----------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_release_follows_the_window(block_size: int, window: int) -> None:
    """Decoding token by token past the window: after each token, exactly the blocks wholly
    left of the next token's window (positions < computed - window + 1) are back in the pool,
    their table entries keep their ids, and the sequence holds at most ``peak_blocks``."""
    bm = BlockManager(256, block_size, window)  # no block is reused: all released ones are free
    other = _seq(3)  # a second sequence keeps its blocks throughout
    bm.allocate(other, 3)
    seq = _seq(1)
    for _ in range(6 * window + 2 * block_size):
        bm.allocate(seq, 1)
        table = list(seq.block_table)
        seq.num_computed_tokens += 1
        seq.append_token(random.randrange(1000))
        released_before = seq.num_released_blocks
        gave = bm.release(seq)
        keep_from = max(0, seq.num_computed_tokens - window + 1) // block_size
        assert seq.num_released_blocks == keep_from == released_before + gave
        assert seq.block_table == table, "released entries must keep their ids"
        assert all(bm.ref_count(b) == 0 for b in table[:keep_from])
        assert all(bm.ref_count(b) == 1 for b in seq.held_blocks)
        assert len(seq.held_blocks) <= bm.peak_blocks(seq.num_tokens, 1)
        _assert_consistent(bm, [seq, other])
        assert bm.release(seq) == 0, "a second release gives nothing"
    assert bm.usage() == (len(seq.held_blocks) + len(other.block_table)) / 256
    bm.free(seq)
    bm.free(other)
    assert bm.num_free_blocks == 256 and seq.num_released_blocks == 0 and seq.block_table == []


def test_release_after_chunks_and_reuse() -> None:
    """Prefill chunks of 6 tokens, window 8, blocks of 4: the blocks given back are reused by
    another sequence while the first one's table still names them (a positional table)."""
    bm = BlockManager(6, 4, window=8)
    seq = _seq(30)
    released = []
    for start in range(0, 30, 6):
        bm.allocate(seq, 6)
        seq.num_computed_tokens = start + 6
        bm.release(seq)
        released.append(seq.num_released_blocks)
    # computed 6, 12, 18, 24, 30 -> first position read next 0, 5, 11, 17, 23 -> blocks 0,1,2,4,5
    assert released == [0, 1, 2, 4, 5]
    assert len(seq.block_table) == 8 and len(seq.held_blocks) == 3
    other = _seq(12)
    bm.allocate(other, 12)  # the 3 free blocks, some of them named in seq's released entries
    assert set(other.block_table) & set(seq.block_table[:5])
    _assert_consistent(bm, [seq, other])
    bm.free(seq)
    assert bm.num_free_blocks == 3 and all(bm.ref_count(b) == 1 for b in other.block_table)
    _assert_consistent(bm, [other])


def test_no_window_releases_nothing() -> None:
    bm = BlockManager(16, 4)
    seq = _seq(40)
    bm.allocate(seq, 40)
    seq.num_computed_tokens = 40
    assert bm.release(seq) == 0 and seq.num_released_blocks == 0
    assert bm.peak_blocks(40, 8) == 10 == peak_blocks(40, 4, 0, 8)


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("window", [1, 3, 16, 21])
@pytest.mark.parametrize("step", [1, 5, 16])
def test_peak_blocks_is_the_exact_maximum(block_size: int, window: int, step: int) -> None:
    """``peak_blocks`` against brute force: the most blocks any step of at most ``step``
    tokens from any start holds (from the block of its first position read to that of its
    last position), over sequences of every length up to 120."""
    for num_tokens in range(1, 120):
        most = 0
        for s in range(num_tokens):
            for n in range(1, min(step, num_tokens - s) + 1):
                first = max(0, s - window + 1) // block_size
                most = max(most, (s + n - 1) // block_size - first + 1)
        assert peak_blocks(num_tokens, block_size, window, step) == most, num_tokens
