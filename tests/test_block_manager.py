"""BlockManager: block tables, reference counts, exhaustion and misuse."""

from __future__ import annotations

import random

import pytest

from flashserve.engine.block_manager import BlockError, BlockManager
from flashserve.engine.sequence import Sequence


def _seq(num_tokens: int) -> Sequence:
    return Sequence([random.randrange(1000) for _ in range(num_tokens)])


def _assert_consistent(bm: BlockManager, seqs: list[Sequence]) -> None:
    """Every block is either free or held, and its ref count is its number of holders."""
    holders = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
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
