"""The Gluon prefill kernel played out on the CPU: its synchronization and its arithmetic (no
Gluon interpreter in Triton 3.6, and a hang on the GPU says nothing about where it hangs).

Synchronization: a model of ``kernels.prefill_gluon``'s three partitions as Python generators,
with the kernel's own loop bounds, ring indices and barrier parities, run by a scheduler that
picks a random runnable partition at every step and lets bulk copies land late and out of
order. An mbarrier here is what PTX says: a phase completes when its expected arrivals are in,
and a wait on parity ``p`` passes once the current phase's parity differs from ``p`` (a fresh
barrier passes a wait on 1). Checked: no deadlock; every K/V tile a consumer reads is the one
it expects, fully landed; the producer never overwrites a stage that either consumer still
reads; with ping-pong the two warpgroups' MMA issues strictly alternate.

Arithmetic: a consumer warpgroup's loop in float64 torch, in the kernel's order (P V of tile
j-1 accumulated before tile j's rescale; tiles addressed through the ``[N * PAGE, Hkv * D]``
view; dead V rows zeroed in the last tile only), against ``kernels.reference`` over pools with
NaN past every sequence's end.

Addresses: every global access of a launch (the consumers' Q loads, an item ahead and past the
last wave included, their stores, the producer's block-table entries and copies) walked with
the kernel's index arithmetic and checked against its tensor, over batches of several
sequences; Out written once per token and head.

When the kernel's loops, parities, arithmetic or masks change, change them here too
(``_work_item``, ``_load_q``, ``_producer``, ``_consumer``, ``_take_turn``, ``_softmax``)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tensor_checks import cu_of

from kernels import reference

BLOCK_M = 128


class Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.phase = count, 0, 0

    def arrive(self):
        self.pending += 1
        assert self.pending <= self.count
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def passed(self, parity: int) -> bool:
        return self.phase % 2 != parity


def deal(wave, pid, progs, n_tiles, n_heads, n_seqs):
    """``_work_item``: (item, tile, head, sequence) of program ``pid`` in wave ``wave``. Past
    the work (item >= n_tiles * n_heads * n_seqs) the sequence is still one of the batch (a
    modulo) but the tile is negative."""
    per_row = n_heads * n_seqs
    item = wave * progs + pid + wave % 2 * (progs - 1 - 2 * pid)
    return item, n_tiles - 1 - item // per_row, item % n_heads, item % per_row // n_heads


def work_items(pid, progs, n_tiles, n_heads, seqs):
    """(tile, head, sequence) per wave, as ``_work_item`` deals them (None: past the end)."""
    n_items = n_tiles * n_heads * len(seqs)
    for wave in range(-(-n_items // progs)):
        item, tile, h, b = deal(wave, pid, progs, n_tiles, n_heads, len(seqs))
        if item < n_items:
            yield tile, h, b


def kv_tiles(tile, seq, block_n):
    """The KV tiles of a work item (0 if the tile is past the chunk)."""
    q_len, seq_len = seq
    m0 = tile * BLOCK_M
    if m0 >= q_len:
        return 0
    hi = min(seq_len - q_len + m0 + BLOCK_M, seq_len)
    return -(-hi // block_n)


class Model:
    def __init__(self, seqs, n_heads, progs, pid, stages, block_n, pingpong, rng):
        self.seqs, self.n_heads, self.progs, self.pid = seqs, n_heads, progs, pid
        self.stages, self.block_n, self.pingpong, self.rng = stages, block_n, pingpong, rng
        self.n_tiles = -(-max(q for q, _ in seqs) // BLOCK_M)
        self.k_ready = [Barrier(1) for _ in range(stages)]
        self.v_ready = [Barrier(1) for _ in range(stages)]
        self.empty = [Barrier(2) for _ in range(stages)]
        self.turns = [Barrier(1), Barrier(1)]
        self.stage = [None] * stages  # the tile a stage holds (or is being filled with)
        self.readers = [set() for _ in range(stages)]  # consumers that have not released it
        self.in_flight = []  # copies issued, not landed: (barrier, stage)
        self.issues = []  # warpgroup of each MMA issue, in order

    def items(self):
        return work_items(self.pid, self.progs, self.n_tiles, self.n_heads, self.seqs)

    def producer(self):
        c = 0
        for tile, h, b in self.items():
            for j in range(kv_tiles(tile, self.seqs[b], self.block_n)):
                s = c % self.stages
                yield self.empty[s], (c // self.stages & 1) ^ 1
                assert not self.readers[s], f"stage {s} overwritten while read by {self.readers}"
                self.stage[s] = (tile, h, b, j)
                self.readers[s] = {0, 1}
                self.in_flight += [(self.k_ready[s], s), (self.v_ready[s], s)]
                c += 1

    def take_turn(self, wg, t):
        if self.pingpong:
            yield self.turns[wg], (t & 1) ^ (1 - wg)

    def issue(self, wg):
        self.issues.append(wg)
        if self.pingpong:
            self.turns[1 - wg].arrive()

    def read(self, wg, s, want):
        assert self.stage[s] == want and wg in self.readers[s], (wg, s, self.stage[s], want)

    def release(self, wg, s):
        self.readers[s].discard(wg)
        self.empty[s].arrive()

    def consumer(self, wg):
        c = t = 0
        S = self.stages
        for tile, h, b in self.items():
            n_kv = kv_tiles(tile, self.seqs[b], self.block_n)
            if not n_kv:
                continue
            s = c % S
            yield self.k_ready[s], c // S & 1
            self.read(wg, s, (tile, h, b, 0))
            yield from self.take_turn(wg, t)
            self.issue(wg)
            t += 1
            for j in range(1, n_kv):
                prev, s = s, (c + j) % S
                yield self.k_ready[s], (c + j) // S & 1
                yield self.v_ready[prev], (c + j - 1) // S & 1
                self.read(wg, s, (tile, h, b, j))
                self.read(wg, prev, (tile, h, b, j - 1))
                yield from self.take_turn(wg, t)
                self.issue(wg)
                t += 1
                self.release(wg, prev)
            yield self.v_ready[s], (c + n_kv - 1) // S & 1
            self.read(wg, s, (tile, h, b, n_kv - 1))
            yield from self.take_turn(wg, t)
            self.issue(wg)
            t += 1
            self.release(wg, s)
            c += n_kv

    def run(self):
        parts = {"producer": self.producer(), 0: self.consumer(0), 1: self.consumer(1)}
        waits = {name: next(gen, None) for name, gen in parts.items()}
        while any(w is not None for w in waits.values()) or self.in_flight:
            ready = [n for n, w in waits.items() if w is not None and w[0].passed(w[1])]
            if self.in_flight and (not ready or self.rng.random() < 0.3):
                bar, _ = self.in_flight.pop(self.rng.randrange(len(self.in_flight)))
                bar.arrive()  # a copy lands (its bytes complete the phase)
                continue
            assert ready, f"deadlock: {waits}"
            name = self.rng.choice(ready)
            waits[name] = next(parts[name], None)


CASES = [  # (sequences as (chunk, total length), heads, programs, stages, block_n)
    ([(300, 300)], 2, 1, 2, 128),
    ([(1, 1), (17, 117), (700, 3700), (129, 193)], 3, 2, 3, 64),
    ([(1000, 1000), (1, 5000)], 2, 3, 2, 128),
    ([(129, 129), (64, 64)], 4, 5, 4, 64),  # waves longer than the work
]


@pytest.mark.parametrize("seqs,n_heads,progs,stages,block_n", CASES)
@pytest.mark.parametrize("pingpong", [True, False])
def test_gluon_kernel_protocol_never_deadlocks_or_races(seqs, n_heads, progs, stages, block_n,
                                                        pingpong):  # fmt: skip
    for seed in range(3):
        for pid in range(progs):
            m = Model(seqs, n_heads, progs, pid, stages, block_n, pingpong, random.Random(seed))
            m.run()
            if pingpong:  # strictly alternating issues, warpgroup 0 first
                assert m.issues == [0, 1] * (len(m.issues) // 2), m.issues[:20]
            assert all(not r for r in m.readers)
            assert m.issues.count(0) == m.issues.count(1)


def test_every_work_item_is_dealt_once():
    seqs = [(300, 500), (1, 1), (2000, 2000)]
    n_tiles = -(-2000 // BLOCK_M)
    for progs in (1, 7, 132):
        got = [i for p in range(progs) for i in work_items(p, progs, n_tiles, 4, seqs)]
        assert sorted(got) == sorted(
            (t, h, b) for t in range(n_tiles) for h in range(4) for b in range(len(seqs))
        )


def test_the_model_catches_a_broken_protocol():
    """The model is not vacuous: a 1-stage ring deadlocks (a stage is released only after the
    next tile's S is issued), an ``empty`` barrier completed by one consumer lets the producer
    overwrite a stage the other still reads or drifts the parities into a deadlock, and
    swapped turn parities break the alternation."""
    seqs = [(700, 3700), (129, 193)]
    with pytest.raises(AssertionError, match="deadlock"):
        Model(seqs, 3, 2, 0, 1, 64, True, random.Random(0)).run()
    m = Model(seqs, 3, 2, 0, 2, 64, True, random.Random(0))
    for bar in m.empty:
        bar.count = 1
    with pytest.raises(AssertionError, match="overwritten|deadlock"):
        m.run()
    m = Model(seqs, 3, 2, 0, 2, 64, True, random.Random(0))
    m.take_turn = lambda wg, t: iter([(m.turns[wg], (t & 1) ^ wg)])
    m.run()
    assert m.issues != [0, 1] * (len(m.issues) // 2)


def q_rows_mask(offs_m, q_len):
    """``_load_q``'s mask over a warpgroup's 64 query offsets in the chunk (``q_len`` is 0 for
    an item past the work, whose offsets are negative)."""
    return (offs_m >= 0) & (offs_m < q_len)


def kernel_accesses(qlens, lens, bt, n_pages, page, n_heads, hkv, head_dim, block_n, progs,
                    q_mask=q_rows_mask):  # fmt: skip
    """Every global access of one launch of ``_gluon_prefill_kernel``, walked with the kernel's
    own index arithmetic: ``(tensor, first, end, bound)``, indices ``[first, end)`` that must
    lie in ``[0, bound)`` (rows of Q, Out and LSE; entries of the int tensors; a block-table
    entry by its column; pool rows of the ``[N * PAGE, Hkv * D]`` view that a copy reads, and
    its KV head). The consumers' Q loads (an item ahead, the wave after the last included; at
    d256 at the item's start), chunk offsets and lengths and stores; the producer's lengths,
    block-table entries (a tile ahead) and copies. Also returns how often each (token, head)
    of Out is written."""
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    n_seqs, t = len(qlens), cu[-1]
    n_tiles = -(-max(qlens) // BLOCK_M)
    n_items = n_tiles * n_heads * n_seqs
    waves = -(-n_items // progs)
    group, q_ahead = n_heads // hkv, head_dim <= 128
    acc, written = [], torch.zeros(t, n_heads, dtype=torch.int64)

    def entries(name, b, bound):
        acc.append((name, b, b + 1, bound))

    def load_q(pid, wave, wg):
        item, tile, h, b = deal(wave, pid, progs, n_tiles, n_heads, n_seqs)
        entries("cu_seqlens_q", b, n_seqs + 1)
        entries("cu_seqlens_q", b + 1, n_seqs + 1)
        q_len = cu[b + 1] - cu[b] if item < n_items else 0
        offs_m = tile * BLOCK_M + wg * 64 + torch.arange(64)
        rows = cu[b] + offs_m[q_mask(offs_m, q_len)]
        if len(rows):
            acc.append(("q", int(rows.min()), int(rows.max()) + 1, t))

    for pid in range(progs):
        for wg in range(2):  # _consumer
            if q_ahead:
                load_q(pid, 0, wg)
            for wave in range(waves):
                item, tile, h, b = deal(wave, pid, progs, n_tiles, n_heads, n_seqs)
                entries("cu_seqlens_q", b, n_seqs + 1)
                entries("cu_seqlens_q", b + 1, n_seqs + 1)
                q_len, m0 = cu[b + 1] - cu[b], tile * BLOCK_M
                if item >= n_items or m0 >= q_len:
                    if q_ahead:
                        load_q(pid, wave + 1, wg)
                    continue
                entries("seq_lens", b, n_seqs)
                load_q(pid, wave + 1 if q_ahead else wave, wg)
                offs_m = m0 + wg * 64 + torch.arange(64)
                rows = cu[b] + offs_m[offs_m < q_len]
                if len(rows):  # (the second warpgroup of a last tile may have none)
                    for name in ("out", "lse"):
                        acc.append((name, int(rows.min()), int(rows.max()) + 1, t))
                    written[rows, h] += 1
        for wave in range(waves):  # _producer
            item, tile, h, b = deal(wave, pid, progs, n_tiles, n_heads, n_seqs)
            if item >= n_items:
                continue
            entries("cu_seqlens_q", b, n_seqs + 1)
            entries("cu_seqlens_q", b + 1, n_seqs + 1)
            q_len, m0 = cu[b + 1] - cu[b], tile * BLOCK_M
            if m0 >= q_len:
                continue
            entries("seq_lens", b, n_seqs)
            seq_len = lens[b]
            hi = min(seq_len - q_len + m0 + BLOCK_M, seq_len)
            entries("block_tables", b * bt.shape[1], bt.numel())
            entries("block_table_column", 0, bt.shape[1])
            next_row = int(bt[b, 0]) * page
            for j in range(-(-hi // block_n)):
                row, nxt = next_row, (j + 1) * block_n
                entry = 0
                if nxt < hi:
                    entries("block_table_column", nxt // page, bt.shape[1])
                    entry = int(bt[b, nxt // page])
                next_row = entry * page + nxt % page
                acc.append(("kv_pool_rows", row, row + block_n, n_pages * page))
                entries("kv_head", h // group, hkv)
    return acc, written


def out_of_bounds(accesses):
    """{tensor: (lowest index, highest end, bound, accesses)} over the accesses that leave
    their tensor."""
    bad = {}
    for name, lo, hi, bound in accesses:
        if lo < 0 or hi > bound:
            low, high, _, count = bad.get(name, (lo, hi, bound, 0))
            bad[name] = (min(low, lo), max(high, hi), bound, count + 1)
    return bad


def paged_table(lens, page, width=None, seed=0):
    """A block table of each sequence's pages, shuffled in a pool with 2 spare pages
    (``width`` wider than needed: zeros past each sequence's pages); (table, pages)."""
    need = [-(-n // page) for n in lens]
    n_pages = sum(need) + 2
    ids = torch.randperm(n_pages, generator=torch.Generator().manual_seed(seed))
    bt = torch.zeros(len(lens), width or max(need), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = ids[pos : pos + n].int()
        pos += n
    return bt, n_pages


WALK_CASES = {  # (chunks, cached tokens before each, Hq, Hkv, head dim, page, programs)
    # tests/test_kernels_gpu.py::test_prefill_sm90_paths_cuda_graph_replay's eager call on
    # an H200 (132 SMs): an illegal memory access there (2026-11-26)
    "graph-replay-eager": ([1024, 1024], [0, 0], 32, 8, 128, 128, 132),
    "gluon-bf16-d128-page64": ([1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64], 32, 8, 128, 64, 132),
    "gluon-bf16-d256": ([1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64], 16, 4, 256, 64, 132),
    "one-sequence-4k": ([4096], [0], 32, 8, 128, 128, 132),  # kernels.bench prefill at 4K
    "one-program": ([300, 1, 513], [77, 1000, 0], 8, 2, 128, 128, 1),
    "waves-past-the-work": ([129, 64], [0, 0], 4, 2, 64, 64, 5),
}


@pytest.mark.parametrize("case", WALK_CASES)
def test_every_access_of_the_kernel_is_in_bounds(case):
    """Every address the kernel computes lies in its tensor (multi-sequence batches, ragged
    chunks, cached context, GQA, the default tiles of each head dim, a wider block table as in
    the graph-replay test), and every (token, head) of Out is written exactly once."""
    from kernels.prefill_gluon import gluon_config

    qlens, ctx, hq, hkv, d, page, progs = WALK_CASES[case]
    lens = [a + b for a, b in zip(qlens, ctx)]
    bt, n_pages = paged_table(lens, page, width=24 if case == "graph-replay-eager" else None)
    if case == "graph-replay-eager":
        bt.zero_()  # the test's eager call: every entry page 0
    cfg = gluon_config(d, torch.bfloat16, page)
    progs = min(progs, -(-max(qlens) // BLOCK_M) * hq * len(qlens))  # launch_args' grid
    acc, written = kernel_accesses(qlens, lens, bt, n_pages, page, hq, hkv, d, cfg.block_n, progs)
    assert not out_of_bounds(acc), out_of_bounds(acc)
    assert (written == 1).all(), (written != 1).nonzero()[:5]


def test_the_walk_catches_the_look_ahead_read_before_q():
    """The walk is not vacuous: with ``_load_q``'s mask as it was (``offs_m < q_len`` alone),
    the look-ahead of the items past the work (negative tiles, ``q_len`` 0) reads rows before
    the first sequence's start; on the graph-replay test's input 384 rows of 32 heads x 128
    bf16, 3 MiB before Q (the H200's illegal memory access). Every other access stays in."""
    qlens, ctx, hq, hkv, d, page, progs = WALK_CASES["graph-replay-eager"]
    bt = torch.zeros(2, 24, dtype=torch.int32)
    acc, _ = kernel_accesses(qlens, qlens, bt, 52, page, hq, hkv, d, 128, progs,
                             q_mask=lambda offs_m, q_len: offs_m < q_len)  # fmt: skip
    bad = out_of_bounds(acc)
    assert list(bad) == ["q"] and bad["q"][0] == -384, bad


def emulate_consumer(q, pool_k, pool_v, bt, seq_len, q_len, ctx_m0, wg, kv_head, scale, block_n,
                     page):  # fmt: skip
    """One warpgroup's 64 queries of a work item, as ``_consumer`` computes them (float64).
    ``q``: [64, D] (rows past the chunk zero, as the masked load leaves them); ``pool_*``:
    the pools as [N * PAGE, Hkv * D]. Returns (out [64, D], lse [64])."""
    d = q.shape[1]
    qk_scale = scale * math.log2(math.e)
    q_first = ctx_m0 + wg * 64
    hi = min(ctx_m0 + BLOCK_M, seq_len)
    n_kv = -(-hi // block_n)

    def tile(pool, j):
        start = j * block_n
        row = int(bt[start // page]) * page + start % page
        return pool[row : row + block_n, kv_head * d : (kv_head + 1) * d].clone()

    def softmax(s, m_i, l_i, start):
        if start + block_n > q_first + 1:
            kv = start + torch.arange(block_n, dtype=torch.float64)
            q_pos = q_first + torch.arange(64, dtype=torch.float64)
            s = torch.where(kv[None, :] <= q_pos[:, None], s, -math.inf)
        m_new = torch.maximum(m_i, s.amax(1) * qk_scale)
        p = torch.exp2(s * qk_scale - m_new[:, None])
        alpha = torch.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + p.sum(1)

    m_i = torch.full((64,), -math.inf, dtype=torch.float64)
    l_i = torch.zeros(64, dtype=torch.float64)
    p, _, m_i, l_i = softmax(q @ tile(pool_k, 0).T, m_i, l_i, 0)
    acc = torch.zeros(64, d, dtype=torch.float64)
    for j in range(1, n_kv):
        s = q @ tile(pool_k, j).T
        acc = acc + p @ tile(pool_v, j - 1)
        p, alpha, m_i, l_i = softmax(s, m_i, l_i, j * block_n)
        acc = acc * alpha[:, None]
    v = tile(pool_v, n_kv - 1)
    last = (n_kv - 1) * block_n
    if last + block_n > seq_len:
        v[seq_len - last :] = 0
    acc = acc + p @ v
    return acc / l_i[:, None], (m_i + torch.log2(l_i)) * math.log(2)


@pytest.mark.parametrize("block_n,page", [(128, 128), (64, 128), (64, 64)])
def test_consumer_arithmetic_matches_the_reference(block_n, page):
    """GQA, chunks over cached context, one-token chunks, lengths off every edge, NaN past
    each sequence's end in the pools: the kernel's loop gives the reference's output and LSE."""
    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 32
    qlens, ctx = [1, 130, 300, 64], [0, 77, 0, 200]
    lens = [a + b for a, b in zip(qlens, ctx)]
    need = [-(-n // page) for n in lens]
    n_pages = sum(need) + 2
    k = torch.randn(n_pages, page, hkv, d, dtype=torch.float64)
    v = torch.randn(n_pages, page, hkv, d, dtype=torch.float64)
    ids = torch.randperm(n_pages)
    bt = torch.zeros(len(lens), max(need), dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = ids[pos : pos + n].int()
        pos += n
    cu = cu_of(qlens, "cpu")
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(qlens), hq, d, dtype=torch.float64)
    ref, ref_lse = reference.prefill_attention(q, k, v, cu, sl, bt, d**-0.5, return_lse=True)
    bad_k, bad_v = k.clone(), v.clone()
    for b, n in enumerate(lens):
        last, off = divmod(n, page)
        if off:
            bad_k[bt[b, last].long(), off:] = bad_v[bt[b, last].long(), off:] = math.nan
    pool_k, pool_v = (x.reshape(n_pages * page, hkv * d) for x in (bad_k, bad_v))
    out = torch.full_like(q, math.nan)
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float64)
    for b, (q_len, seq_len) in enumerate(zip(qlens, lens)):
        for m0 in range(0, q_len, BLOCK_M):
            for h in range(hq):
                for wg in range(2):
                    w0 = m0 + wg * 64
                    rows = torch.arange(w0, w0 + 64)
                    qw = torch.zeros(64, d, dtype=torch.float64)
                    live = rows < q_len
                    qw[live] = q[cu[b] + rows[live], h]
                    o, l_ = emulate_consumer(qw, pool_k, pool_v, bt[b], seq_len, q_len,
                                             seq_len - q_len + m0, wg, h // (hq // hkv),
                                             d**-0.5, block_n, page)  # fmt: skip
                    out[cu[b] + rows[live], h] = o[live]
                    lse[cu[b] + rows[live], h] = l_[live]
    assert torch.allclose(out, ref, atol=1e-10), (out - ref).abs().max()
    assert torch.allclose(lse, ref_lse.double(), atol=1e-5), (lse - ref_lse).abs().max()
