"""The Triton kernels in bf16 on a CUDA GPU, at realistic sizes, and decode under CUDA graphs.

References are kernels/reference.py on float32 upcasts of the bf16 inputs, computed on the GPU
(float32 error is far below bf16's). Run on the GPU machine:
``python3 -m pytest -q tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensor_checks import assert_close, capture_graph, cu_of

from kernels import reference

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # bf16 operands (p cast to bf16 before P @ V): measured ~4e-3
LSE_TOL = 2e-3


def _lazy():
    from kernels.decode import decode_attention
    from kernels.prefill import prefill_attention
    from kernels.rope import rope_write_kv

    return decode_attention, prefill_attention, rope_write_kv


def paged(lens, hkv, d, page, dtype=torch.bfloat16, width=None):
    """Random K/V pools with each sequence in shuffled blocks; (k, v, block_tables, seq_lens)."""
    need = [-(-n // page) for n in lens]
    width = width or max(need)
    total = sum(need) + 4
    k = torch.randn(total, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(total, page, hkv, d, device="cuda", dtype=dtype)
    ids = torch.randperm(total, device="cuda").int()
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cuda")
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = ids[pos : pos + n]
        pos += n
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return k, v, bt, seq_lens


def rope_tables(d, positions=70000):
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.arange(positions, device="cuda").float()[:, None] * inv[None, :]
    return freqs.cos().bfloat16(), freqs.sin().bfloat16()


def test_rope_write_kv_bf16_llama_shape():
    """The engine's KV store (RoPE fused with it) at Llama-3-8B heads, 300 tokens, every 7th
    a padding slot: the same bits as the reference in the cache and the queries."""
    *_, rope_write_kv = _lazy()
    t, hq, hkv, d, page = 300, 32, 8, 128, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 70000, (t,), device="cuda")
    cos, sin = rope_tables(d)
    slots = torch.randperm(64 * page, device="cuda")[:t]
    slots[::7] = -1
    kc = torch.randn(64, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kr, vr = kc.clone(), vc.clone()
    q = rope_write_kv(qkv, pos, cos, sin, kc, vc, slots, hq, hkv)
    q_ref = reference.rope_write_kv(qkv, pos, cos, sin, kr, vr, slots, hq, hkv)
    assert torch.equal(q, q_ref) and torch.equal(kc, kr) and torch.equal(vc, vr)


@pytest.mark.parametrize(
    "hq,hkv,d,page",
    [(32, 8, 128, 16), (32, 8, 128, 128), (16, 16, 64, 16), (24, 8, 96, 16), (16, 2, 256, 32)],
)
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_bf16(hq, hkv, d, page, splits):
    decode_attention, *_ = _lazy()
    lens = [32768, 1, 4097, 1000, 17]
    k, v, bt, sl = paged(lens, hkv, d, page)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    out, lse = decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=32768, out=out,
                                return_lse=True, num_splits=splits)  # fmt: skip
    ref, ref_lse = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5,
                                              return_lse=True)  # fmt: skip
    assert_close(out, ref, BF16_TOL, "decode out")
    assert_close(lse, ref_lse, LSE_TOL, "decode lse")


def test_decode_cuda_graph_replay():
    """One capture at max_seq_len 8192; replays with new seq_lens, block tables and queries."""
    decode_attention, *_ = _lazy()
    bsz, hq, hkv, d, page, max_len = 4, 32, 8, 128, 16, 8192
    k, v, _, _ = paged([max_len] * bsz, hkv, d, page)
    q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(bsz, max_len // page, dtype=torch.int32, device="cuda")
    sl = torch.ones(bsz, dtype=torch.int32, device="cuda")
    outs = {}
    for mode in ("split", "fixed"):
        kw = {"split_size": 512} if mode == "fixed" else {}
        graph, outs[mode] = capture_graph(
            lambda kw=kw: decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=max_len, **kw)
        )
        for lens in ([1, 8192, 300, 17], [5000, 64, 65, 8000], [2, 3, 4, 1]):
            bt.copy_(torch.randperm(k.shape[0], device="cuda")[: bsz * bt.shape[1]].view_as(bt))
            sl.copy_(torch.tensor(lens, dtype=torch.int32))
            q.copy_(torch.randn_like(q))
            outs[mode].fill_(float("nan"))
            graph.replay()
            ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5)
            assert_close(outs[mode], ref, BF16_TOL, f"graph replay {mode} {lens}")


def test_decode_fixed_split_batch_invariant_bf16():
    decode_attention, *_ = _lazy()
    k, v, bt, sl = paged([20000, 3000, 77, 9000], 8, 128, 16)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    full = decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=20000, split_size=1024)
    alone = decode_attention(q[2:3], k, v, sl[2:3], bt[2:3], 0.088, max_seq_len=32768,
                             split_size=1024)  # fmt: skip
    assert torch.equal(full[2:3], alone)


@pytest.mark.parametrize("page", [16, 64, 128])
def test_decode_page_and_tile_edges_bf16(page):
    """bf16, Llama-3-8B heads, against the reference: lengths ending inside a page, inside a
    tile, on an edge; pages shorter, as long as and longer than the KV tile."""
    from kernels.decode import DecodeTuning, decode_attention

    k, v, bt, sl = paged([4096, 1000, 17, 64, 3001], 8, 128, page)
    q = torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, 0.088)
    for kw in ({}, {"num_splits": 1}, {"split_size": 512},
               {"tuning": DecodeTuning(tiles=(128, 4, 2))},
               {"tuning": DecodeTuning(few_rows_tiles=(128, 4, 3))}):  # fmt: skip
        out = decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=4096, **kw)
        assert_close(out, ref, BF16_TOL, f"decode {page=} {kw}")


@pytest.mark.parametrize("page, window", [(16, 0), (128, 0), (16, 1000)])
def test_decode_l2_prefetch_does_not_change_the_result(page, window):
    """The chained launch's L2 prefetch before the wait (``DecodeTuning.prefetch_tokens``)
    reads nothing into the result: bit-identical output and LSE with none, part of a split
    and more than a split prefetched, and right."""
    from kernels.decode import DecodeTuning, decode_attention

    k, v, bt, sl = paged([4096, 1000, 17, 3001], 8, 128, page)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = [decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=4096, return_lse=True,
                             window=window, tuning=DecodeTuning(prefetch_tokens=n))
            for n in (0, 64, 100, 1 << 20)]  # fmt: skip
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, 0.088,
                                     window=window)  # fmt: skip
    assert_close(runs[1][0], ref, BF16_TOL, f"decode with an L2 prefetch, {page=} {window=}")


def test_decode_stage_count_does_not_change_the_result():
    """Tiles that differ only in their pipeline stages (``DecodeTuning.tiles``): bit-identical
    output and LSE (only when loads are issued changes), and right."""
    from kernels.decode import DecodeTuning, decode_attention

    k, v, bt, sl = paged([4096, 1000, 3001], 8, 128, 16)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = [decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=4096, return_lse=True,
                             num_splits=8, tuning=DecodeTuning(tiles=(64, 4, stages)))
            for stages in (2, 3, 4)]  # fmt: skip
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
    ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, 0.088)
    assert_close(runs[0][0], ref, BF16_TOL, "decode (64, 4, 2)")


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("page", [16, 128])
def test_prefill_bf16(d, page):
    _, prefill_attention, _ = _lazy()
    hq, hkv = 16, 4
    qlens, ctx = [1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64]
    k, v, bt, sl = paged([a + b for a, b in zip(qlens, ctx)], hkv, d, page)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=max(qlens),
                                 max_seq_len=int(sl.max()), out=out, return_lse=True)  # fmt: skip
    ref, ref_lse = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt,
                                               d**-0.5, return_lse=True)  # fmt: skip
    assert_close(out, ref, BF16_TOL, f"prefill d={d} out")
    assert_close(lse, ref_lse, LSE_TOL, f"prefill d={d} lse")


def test_prefill_llama3_8b_4k_chunked():
    """A 4K prompt of Llama-3-8B heads at once, and as 3 chunks over the cached context."""
    _, prefill_attention, _ = _lazy()
    n, hq, hkv, d = 4096, 32, 8, 128
    k, v, bt, sl = paged([n], hkv, d, 16)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    whole = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=n)
    ref = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt, d**-0.5)
    assert_close(whole, ref, BF16_TOL, "prefill 4K")
    parts = []
    for a, b in ((0, 1000), (1000, 1001), (1001, n)):
        cu_c = torch.tensor([0, b - a], dtype=torch.int32, device="cuda")
        sl_c = torch.tensor([b], dtype=torch.int32, device="cuda")
        parts.append(prefill_attention(q[a:b], k, v, cu_c, sl_c, bt, d**-0.5, max_query_len=b - a))
    assert_close(torch.cat(parts), whole, 1e-2, "chunked vs whole")


def test_decode_pdl_matches_plain_launches():
    """Stage 1 launched early (PDL, and in the chain) waits for the kernel before it: the
    same bits as plain launches, and no warning (the device's Triton takes PDL launches)."""
    import warnings

    from kernels.decode import DecodeTuning, decode_attention

    k, v, bt, sl = paged([4096, 100, 70000, 1], 8, 128, 16)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="decode: no programmatic dependent launch")
        for on in (True, False):
            tuning = DecodeTuning(pdl=on)
            runs[on] = [decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=70000,
                                         tuning=tuning) for _ in range(20)]  # fmt: skip
    for out in runs[True] + runs[False][1:]:
        assert torch.equal(out, runs[False][0])


@pytest.mark.parametrize("chain", [True, False])
def test_rope_write_kv_then_decode(chain):
    """The engine's order, rope_write_kv then decode (stage 1 may start early under PDL and
    must wait for the store): every step sees the token it just wrote."""
    decode_attention, _, rope_write_kv = _lazy()
    bsz, hq, hkv, d, page = 3, 32, 8, 128, 16
    lens = [1000, 17, 5000]
    k, v, bt, sl = paged([n + 12 for n in lens], hkv, d, page)
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    cos, sin = rope_tables(d)
    for _ in range(12):
        pos = sl.long()  # the new token's position
        slots = bt.gather(1, (pos // page)[:, None]).squeeze(1).long() * page + pos % page
        qkv = torch.randn(bsz, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 4
        sl += 1
        # directly followed by decode's stage 1
        q = rope_write_kv(qkv, pos, cos, sin, k, v, slots, hq, hkv, chain=chain)
        out = decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=8192, chain=chain)
        ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5)
        assert_close(out, ref, BF16_TOL, f"chain={chain} at {sl.tolist()}")


def test_decode_fused_merge_is_race_free():
    """Many splits per (sequence, KV head), so many programs race for the merge: 30 launches
    give the same bits, match the reference, and leave the counters zeroed."""
    from kernels import decode

    decode_attention, *_ = _lazy()
    k, v, bt, sl = paged([65536, 3000, 1, 20000], 8, 128, 16)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, 128**-0.5)
    for splits in (None, 64, 200):
        outs = [decode_attention(q, k, v, sl, bt, 128**-0.5, max_seq_len=65536,
                                 num_splits=splits) for _ in range(30)]  # fmt: skip
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), f"{splits} splits: results differ between runs"
        assert_close(outs[0], ref, BF16_TOL, f"fused merge, {splits} splits")
    torch.cuda.synchronize()
    assert not decode._COUNTERS[q.device].any()


# ---- sliding windows, soft-capping, head dim 256 --------------------------------------------


def windowed_paged(lens, starts, hkv, d, page, dtype=torch.bfloat16):
    """Like ``paged``, but only the pages from ``starts[b]`` on are real: the block-table
    entries left of them point at a page of NaN, and the tokens left of ``starts[b]`` in its
    first page are NaN (pages that "memory follows the window" may have freed and reused).
    A kernel that reads any of them returns NaN. Small pools for 128K contexts, too."""
    first = [s // page for s in starts]
    need = [-(-n // page) - f for n, f in zip(lens, first)]
    width = max(-(-n // page) for n in lens)
    total = sum(need) + 1
    k = torch.randn(total, page, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(total, page, hkv, d, device="cuda", dtype=dtype)
    k[-1], v[-1] = float("nan"), float("nan")
    ids = torch.randperm(total - 1, device="cuda").int()
    bt = torch.full((len(lens), width), total - 1, dtype=torch.int32, device="cuda")
    pos = 0
    for b, (f, n) in enumerate(zip(first, need)):
        bt[b, f : f + n] = ids[pos : pos + n]
        pos += n
        part = starts[b] - f * page
        if n and part:
            k[bt[b, f].long(), :part], v[bt[b, f].long(), :part] = float("nan"), float("nan")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return k, v, bt, seq_lens


@pytest.mark.parametrize(
    "hq,hkv,d,page,window,softcap",
    [(32, 8, 128, 16, 4096, 0.0), (16, 8, 256, 16, 4096, 50.0), (16, 8, 256, 64, 1024, 0.0),
     (32, 8, 128, 128, 4000, 0.0), (8, 4, 256, 16, 4096, 30.0)],
)  # fmt: skip
def test_decode_window_softcap_bf16(hq, hkv, d, page, window, softcap):
    """128K context, a 4K window (and Gemma 3's 1K), Gemma 2's cap of 50, head dim 256; rows
    shorter than, as long as and longer than the window; the pages left of each window are
    NaN and never read."""
    from kernels.decode import decode_attention

    lens = [131072, 1, 4097, window, 5000, 17, 70001]
    k, v, bt, sl = windowed_paged(lens, [max(0, n - window) for n in lens], hkv, d, page)
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    ref, ref_lse = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5,
                                              return_lse=True, window=window,
                                              softcap=softcap)  # fmt: skip
    for kw in ({}, {"num_splits": 1}, {"split_size": 512}):
        out = torch.full_like(q, float("nan"))
        out, lse = decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=131072, out=out,
                                    return_lse=True, window=window, softcap=softcap,
                                    **kw)  # fmt: skip
        assert_close(out, ref, BF16_TOL, f"decode window {window} cap {softcap} {kw}")
        assert_close(lse, ref_lse, LSE_TOL, f"decode lse window {window} {kw}")


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("softcap", [0.0, 50.0])
@pytest.mark.parametrize("path,page", [("portable", 16), ("hopper", 64)])
def test_prefill_window_softcap_bf16(d, softcap, path, page):
    """A 2K chunk at the end of a 128K context with a 4K window, a chunk crossing the window
    edge, a 5K prompt from scratch; pages left of each chunk's first window NaN. The portable
    kernel on 16-token pages, the Hopper path on 64-token ones."""
    from kernels.prefill import prefill_attention

    hq, hkv, window = 16, 8, 4096
    qlens, ctx = [2048, 1, 3000, 5000], [131072 - 2048, 5000, 2000, 0]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = windowed_paged(lens, [max(0, c - window + 1) for c in ctx], hkv, d, page)
    cu = cu_of(qlens)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=max(qlens),
                                 out=out, return_lse=True, window=window,
                                 softcap=softcap, path=path)  # fmt: skip
    ref, ref_lse = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt,
                                               d**-0.5, return_lse=True, window=window,
                                               softcap=softcap)  # fmt: skip
    assert_close(out, ref, BF16_TOL, f"{path} prefill window d={d} cap {softcap}")
    assert_close(lse, ref_lse, LSE_TOL, f"{path} prefill window lse d={d} cap {softcap}")


def test_decode_cuda_graph_windowed_and_global_layers():
    """One graph holding a windowed, soft-capped layer (head dim 256, window 4096) and a global
    one, captured at max_seq_len 32K, replayed with new lengths (below, at and past the
    window), block tables and queries: both layers match the reference each time."""
    from kernels.decode import decode_attention

    bsz, hq, hkv, d, page, max_len, window = 4, 16, 8, 256, 16, 32768, 4096
    pools = [paged([max_len] * bsz, hkv, d, page)[:2] for _ in range(2)]
    q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(bsz, max_len // page, dtype=torch.int32, device="cuda")
    sl = torch.ones(bsz, dtype=torch.int32, device="cuda")
    layers = [{"window": window, "softcap": 50.0}, {}]

    def step():
        return [decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=max_len, **kw)
                for (k, v), kw in zip(pools, layers)]  # fmt: skip

    graph, outs = capture_graph(step)
    n_blocks = pools[0][0].shape[0]
    for lens in ([1, 32768, 4096, 4097], [5000, 64, 30001, 8000], [2, 3, 4, 1]):
        bt.copy_(torch.randperm(n_blocks, device="cuda")[: bsz * bt.shape[1]].view_as(bt))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for (k, v), kw, o in zip(pools, layers, outs):
            ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5,
                                             **kw)  # fmt: skip
            assert_close(o, ref, BF16_TOL, f"graph replay {kw} {lens}")


# ---- prefill, the Hopper path (TMA copies, persistent programs; issue 17) --------------------


def nan_tails(k, v, bt, lens, page):
    """Every slot past each sequence's end in its last page NaN (leftovers of a freed sequence,
    or never written): the Hopper path's unmaskable copies bring them in."""
    for b, n in enumerate(lens):
        last, off = divmod(n, page)
        if off:
            k[bt[b, last].long(), off:], v[bt[b, last].long(), off:] = float("nan"), float("nan")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("per_sm", [None, 0])
def test_prefill_hopper_bf16(d, page, per_sm):
    """Forced Hopper path, its default tiles, persistent (as the default has it: two programs
    an SM at d64) and not (0): GQA, five sequences with cached context, one-token chunks,
    lengths off every edge, NaN past each end; output and LSE against the reference."""
    from kernels.prefill import hopper_config, prefill_attention

    hq, hkv = (32, 8) if d == 128 else (16, 4)
    qlens, ctx = [1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = paged(lens, hkv, d, page)
    ref_k, ref_v = k.float(), v.float()
    nan_tails(k, v, bt, lens, page)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(qlens)
    cfg = hopper_config(d, torch.bfloat16, page)
    cfg = cfg if per_sm is None else (*cfg[:4], per_sm)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=max(qlens), out=out,
                                 return_lse=True, config=cfg, path="hopper")  # fmt: skip
    ref, ref_lse = reference.prefill_attention(q.float(), ref_k, ref_v, cu, sl, bt, d**-0.5,
                                               return_lse=True)  # fmt: skip
    assert_close(out, ref, BF16_TOL, f"hopper prefill d={d} page={page} {cfg}")
    assert_close(lse, ref_lse, LSE_TOL, f"hopper prefill lse d={d} page={page} {cfg}")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_hopper_sweep_configs_are_right(d):
    """Every config ``kernels.bench --sweep hopper`` times compiles (shared memory included)
    and computes the right thing, so the sweep's numbers are of working kernels."""
    from kernels.bench import HOPPER_CONFIGS
    from kernels.prefill import prefill_attention

    qlens, ctx = [1000, 300], [0, 1500]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = paged(lens, 8, d, 128)
    q = torch.randn(sum(qlens), 32, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(qlens)
    ref = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt, d**-0.5)
    for cfg in HOPPER_CONFIGS[d]:
        out = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=1000, config=cfg,
                                path="hopper")  # fmt: skip
        assert_close(out, ref, BF16_TOL, f"hopper d={d} {cfg}")


@pytest.mark.parametrize("window", [0, 1000])
def test_prefill_auto_takes_the_sm90_paths(window):
    """``path="auto"``: on sm_90 under Triton 3.6 the Gluon kernel from 64-token pages on (the
    same bits as ``path="gluon"``), the Hopper path where Gluon refuses (a window) or cannot
    run, the portable kernel on 16-token pages and off sm_90."""
    import triton

    from kernels.prefill import prefill_attention
    from kernels.prefill_paths import gluon_triton_refusal

    cap = torch.cuda.get_device_capability()
    gluon = cap == (9, 0) and gluon_triton_refusal(triton.__version__) is None and not window
    for page in (16, 64, 128):
        k, v, bt, sl = paged([3000], 8, 128, page)
        q = torch.randn(3000, 32, 128, device="cuda", dtype=torch.bfloat16)
        cu = cu_of([3000])
        kw = dict(max_query_len=3000, window=window)
        auto = prefill_attention(q, k, v, cu, sl, bt, 0.088, path="auto", **kw)
        picked = "portable"
        if cap[0] == 9 and page >= 64:
            picked = "gluon" if gluon else "hopper"
        same = prefill_attention(q, k, v, cu, sl, bt, 0.088, path=picked, **kw)
        assert torch.equal(auto, same), (page, picked)


@pytest.mark.parametrize("qlen, ctx", [(64, 60000), (128, 20000), (1, 9000)])
def test_prefill_short_chunk_over_a_long_context_in_kv_parts(qlen, ctx):
    """A few query tiles over a long context: ``path="auto"`` cuts the keys into parts
    (``prefill_kv_splits``; the same bits as ``path="portable"`` with that many), and the
    result is the reference's, LSE included."""
    from kernels.common import num_sms
    from kernels.prefill import prefill_attention, prefill_config, prefill_kv_splits

    k, v, bt, sl = paged([ctx + qlen], 8, 128, 128)
    q = torch.randn(qlen, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = cu_of([qlen])
    kw = dict(max_query_len=qlen, max_seq_len=ctx + qlen, return_lse=True)
    block_m, block_n = prefill_config(128, torch.bfloat16)[:2]
    sms = num_sms(torch.device("cuda"))
    splits = prefill_kv_splits(-(-qlen // block_m) * 32, ctx + qlen, block_n, sms)
    assert splits > 1
    auto, auto_lse = prefill_attention(q, k, v, cu, sl, bt, 0.088, path="auto", **kw)
    same, same_lse = prefill_attention(q, k, v, cu, sl, bt, 0.088, kv_splits=splits, **kw)
    assert torch.equal(auto, same) and torch.equal(auto_lse, same_lse)
    ref, ref_lse = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt,
                                               0.088, return_lse=True)  # fmt: skip
    assert_close(auto, ref, BF16_TOL, f"{splits} parts")
    assert_close(auto_lse, ref_lse, LSE_TOL, f"{splits} parts, lse")


@pytest.mark.parametrize("path", ["hopper", "gluon"])
def test_prefill_sm90_paths_llama3_8b_16k_chunked(path):
    """A 16K prompt of Llama-3-8B heads on 128-token pages at once (on the Gluon kernel 4,096
    work items: ~31 per program), and as 3 chunks over the cached context (the engine's
    chunked prefill), on the Hopper path and the Gluon kernel."""
    if path == "gluon" and not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from kernels.prefill import prefill_attention

    n, hq, hkv, d = 16384, 32, 8, 128
    k, v, bt, sl = paged([n], hkv, d, 128)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    whole = prefill_attention(q, k, v, cu_of([n]), sl, bt, d**-0.5, max_query_len=n,
                              path=path)  # fmt: skip
    # K/V expanded to the 32 query heads: SDPA's memory-efficient float32 kernel then serves
    # the reference, where grouped heads could leave it 32 x 16K x 16K scores to hold
    kx, vx = (x.float().repeat_interleave(hq // hkv, dim=2) for x in (k, v))
    ref = reference.prefill_attention(q.float(), kx, vx, cu_of([n]), sl, bt, d**-0.5)
    assert_close(whole, ref, BF16_TOL, f"{path} prefill 16K")
    parts = []
    for a, b in ((0, 5000), (5000, 5001), (5001, n)):
        sl_c = torch.tensor([b], dtype=torch.int32, device="cuda")
        parts.append(prefill_attention(q[a:b], k, v, cu_of([b - a]), sl_c, bt, d**-0.5,
                                       max_query_len=b - a, path=path))  # fmt: skip
    assert_close(torch.cat(parts), whole, 1e-2, f"{path} chunked vs whole")


@pytest.mark.parametrize("path", ["hopper", "gluon"])
def test_prefill_sm90_paths_cuda_graph_replay(path):
    """The descriptors travel by value in the launch: one capture, replays with new block
    tables, lengths and queries, each right (the Hopper path and the Gluon kernel)."""
    if path == "gluon" and not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from kernels.prefill import prefill_attention

    bsz, n, hq, hkv, d, page = 2, 1024, 32, 8, 128, 128
    k, v, _, _ = paged([3 * n] * bsz, hkv, d, page)  # room for 3n tokens a sequence
    q = torch.randn(bsz * n, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of([n] * bsz)
    bt = torch.zeros(bsz, 3 * n // page, dtype=torch.int32, device="cuda")
    sl = torch.full((bsz,), n, dtype=torch.int32, device="cuda")

    def call():
        return prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=n, path=path)

    graph, out = capture_graph(call)
    for ctx in (0, 700, 2048):  # cached tokens before each chunk of n
        bt.copy_(torch.randperm(k.shape[0], device="cuda")[: bt.numel()].view_as(bt))
        sl.fill_(ctx + n)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt, d**-0.5)
        assert_close(out, ref, BF16_TOL, f"{path} graph replay ctx={ctx}")


# ---- prefill, the Gluon kernel (path="gluon": FlashAttention-3 style, sm_90 only) ------------


def _sm90():
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("pingpong", [True, False])
def test_prefill_gluon_bf16(d, page, pingpong):
    """The Gluon kernel with its default tiles, ping-pong on and off: GQA, five sequences with
    cached context, one-token chunks, lengths off every tile and page edge, NaN in every pool
    slot past each end (the copies bring them in: dead V rows must not poison P @ V), and
    NaN-poisoned outputs (unwritten rows fail); output and LSE against the reference."""
    if not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    import dataclasses

    from kernels.prefill import prefill_attention
    from kernels.prefill_gluon import gluon_config

    hq, hkv = (32, 8) if d == 128 else (16, 4)
    qlens, ctx = [1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = paged(lens, hkv, d, page)
    ref_k, ref_v = k.float(), v.float()
    nan_tails(k, v, bt, lens, page)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(qlens)
    cfg = dataclasses.replace(gluon_config(d, torch.bfloat16, page), pingpong=pingpong)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=max(qlens), out=out,
                                 return_lse=True, config=cfg, path="gluon")  # fmt: skip
    ref, ref_lse = reference.prefill_attention(q.float(), ref_k, ref_v, cu, sl, bt, d**-0.5,
                                               return_lse=True)  # fmt: skip
    assert_close(out, ref, BF16_TOL, f"gluon prefill d={d} page={page} {cfg}")
    assert_close(lse, ref_lse, LSE_TOL, f"gluon prefill lse d={d} page={page} {cfg}")


def test_prefill_gluon_fp16_and_one_program():
    """fp16, and one persistent program doing every work item (many waves, the ring's phases
    wrapping many times): the same answer."""
    if not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from kernels.prefill import prefill_attention
    from kernels.prefill_gluon import GluonConfig

    qlens, ctx = [300, 1, 513], [77, 1000, 0]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = paged(lens, 2, 128, 128, dtype=torch.float16)
    ref_k, ref_v = k.float(), v.float()
    nan_tails(k, v, bt, lens, 128)
    q = torch.randn(sum(qlens), 8, 128, device="cuda", dtype=torch.float16)
    cu = cu_of(qlens)
    ref, ref_lse = reference.prefill_attention(q.float(), ref_k, ref_v, cu, sl, bt, 0.088,
                                               return_lse=True)  # fmt: skip
    for cfg in (GluonConfig(128, 3), GluonConfig(64, 2)):
        out, lse = prefill_attention(q, k, v, cu, sl, bt, 0.088, max_query_len=max(qlens),
                                     return_lse=True, config=cfg, path="gluon")  # fmt: skip
        assert_close(out, ref, 4e-3, f"gluon fp16 {cfg}")
        assert_close(lse, ref_lse, LSE_TOL, f"gluon fp16 lse {cfg}")


# test_prefill_sm90_paths_cuda_graph_replay's eager call, Q allocated first
_GLUON_TWO_SEQUENCES = """
import torch
from kernels.prefill import prefill_attention
q = torch.randn(2048, 32, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(52, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
cu = torch.tensor([0, 1024, 2048], dtype=torch.int32, device="cuda")
sl = torch.full((2,), 1024, dtype=torch.int32, device="cuda")
bt = torch.zeros(2, 24, dtype=torch.int32, device="cuda")
prefill_attention(q, k, v, cu, sl, bt, 128**-0.5, max_query_len=1024, path="gluon")
torch.cuda.synchronize()
"""


def test_prefill_gluon_reads_nothing_before_q():
    """Two sequences of 1,024 tokens (the graph-replay test's eager call, where an H200 hit an
    illegal address: the next item's Q, loaded an item ahead, was not masked for the items past
    the work, whose tiles are negative: up to 384 rows, 3 MiB, before Q). In a process of its
    own (a fault ends the CUDA context), every tensor its own cudaMalloc and Q the first one,
    under compute-sanitizer's memcheck where it is installed: no access outside the tensors.
    Without memcheck only a fault fails it (the bytes before Q may be mapped)."""
    if not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    memcheck = [sanitizer, "--tool", "memcheck", "--error-exitcode", "1"]
    cmd = [*(memcheck if os.path.exists(sanitizer) else []), sys.executable, "-c",
           _GLUON_TWO_SEQUENCES]  # fmt: skip
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    run = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, (cmd[0], run.stdout[-4000:], run.stderr[-4000:])


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_gluon_sweep_configs_are_right(d):
    """Every config ``kernels.bench --sweep gluon`` times runs and is right (pages of 128)."""
    if not _sm90():
        pytest.skip("the Gluon kernel runs on sm_90 only")
    from kernels.bench import GLUON_CONFIGS
    from kernels.prefill import prefill_attention

    qlens, ctx = [1000, 300], [0, 1500]
    lens = [a + b for a, b in zip(qlens, ctx)]
    k, v, bt, sl = paged(lens, 8, d, 128)
    nan_free_k, nan_free_v = k.float(), v.float()
    nan_tails(k, v, bt, lens, 128)
    q = torch.randn(sum(qlens), 32, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(qlens)
    ref = reference.prefill_attention(q.float(), nan_free_k, nan_free_v, cu, sl, bt, d**-0.5)
    for cfg in GLUON_CONFIGS[d]:
        out = prefill_attention(q, k, v, cu, sl, bt, d**-0.5, max_query_len=1000, config=cfg,
                                path="gluon")  # fmt: skip
        assert_close(out, ref, BF16_TOL, f"gluon d={d} {cfg}")


@pytest.mark.parametrize("path", ["portable", "hopper", "gluon"])
def test_prefill_compiles_once_for_every_steps_counts(path):
    """A step's tiles and prompts (``kernels.common.PREFILL_STEP_INTS``) of each kind Triton
    tells apart (1, a multiple of 16, other), and block tables as wide as the engine makes them
    (``kernels.common.table_columns`` of the longest), after a first launch: no second compile
    (Triton's ``jit_cache_hook`` sees none), and each result right."""
    import triton

    if path != "portable" and not _sm90():
        pytest.skip("the sm_90 paths")
    hook_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if hook_knobs is None or not hasattr(hook_knobs, "jit_cache_hook"):
        pytest.skip(f"Triton {triton.__version__} has no jit_cache_hook")
    from kernels.common import table_columns
    from kernels.prefill import prefill_attention

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    # (query lengths, table width): prompts 1 / 16 / 3, tiles of 128 queries 1 / 16 / 17 / 3,
    # longest tables of 128-token pages 1 / 16 / 17 / 20 (16 / 16 / 32 / 32 columns)
    steps = [([100], 1), ([5] * 16, 1), ([300, 20, 7], 3), ([2048], 16), ([17, 2100], 17),
             ([int(n) for n in torch.randint(1, 400, (5,), generator=gen)], 20)]  # fmt: skip
    compiles = []

    def count(*args, **kwargs):
        compiles.append(kwargs.get("repr", "?"))
        return False  # compile as usual

    before = hook_knobs.jit_cache_hook
    try:
        for i, (qlens, width) in enumerate(steps):
            k, v, bt, sl = paged(qlens, 8, 128, 128, width=table_columns(width))
            q = torch.randn(sum(qlens), 32, 128, device="cuda", dtype=torch.bfloat16)
            cu = cu_of(qlens)
            out = prefill_attention(q, k, v, cu, sl, bt, 0.088, max_query_len=max(qlens),
                                    path=path)  # fmt: skip
            torch.cuda.synchronize()
            ref = reference.prefill_attention(q.float(), k.float(), v.float(), cu, sl, bt, 0.088)
            assert_close(out, ref, BF16_TOL, f"{path} step {i} {qlens}")
            if i == 0:  # the first launch compiles (or finds it on disk); then watch
                hook_knobs.jit_cache_hook = count
    finally:
        hook_knobs.jit_cache_hook = before
    assert not compiles, compiles
