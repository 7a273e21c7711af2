"""The Triton kernels in bf16 on a CUDA GPU, at realistic sizes, and decode under CUDA graphs.

References are kernels/reference.py on float32 upcasts of the bf16 inputs, computed on the GPU
(float32 error is far below bf16's). Run on the GPU machine:
``python3 -m pytest -q tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from tensor_checks import assert_close

from kernels import reference

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # bf16 operands (p cast to bf16 before P @ V): measured ~4e-3
LSE_TOL = 2e-3


def _lazy():
    from kernels.decode import decode_attention
    from kernels.kv_write import write_kv
    from kernels.prefill import prefill_attention

    return decode_attention, prefill_attention, write_kv


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


def test_write_kv_bf16():
    *_, write_kv = _lazy()
    t, hkv, d, page = 300, 8, 128, 16
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * page, device="cuda")[:t]
    slots[::7] = -1
    kc = torch.randn(64, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    kr, vr = kc.clone(), vc.clone()
    write_kv(k, v, kc, vc, slots)
    reference.write_kv(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


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
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=max_len, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[mode] = decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=max_len, **kw)
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


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("page_vec", [False, True])
@pytest.mark.parametrize("split_tail", [False, True])
def test_decode_loop_variants_bf16(monkeypatch, page_vec, split_tail, page):
    """The KV-loop tuning variants (kernels.bench --sweep loop) on the GPU, bf16, Llama-3-8B
    heads, against the reference; lengths ending inside a page, inside a tile, on an edge."""
    from kernels import decode

    monkeypatch.setattr(decode, "_LOOP", {"PAGE_VEC": page_vec, "SPLIT_TAIL": split_tail})
    k, v, bt, sl = paged([4096, 1000, 17, 64, 3001], 8, 128, page)
    q = torch.randn(5, 32, 128, device="cuda", dtype=torch.bfloat16)
    ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, 0.088)
    for kw in ({}, {"num_splits": 1}, {"split_size": 512}, {"config": (128, 4, 2)}):
        out = decode.decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=4096, **kw)
        assert_close(out, ref, BF16_TOL, f"decode {page=} {page_vec=} {split_tail=} {kw}")


def test_decode_stage_count_does_not_change_the_result():
    """The heuristic runs short splits with one pipeline stage fewer: bit-identical output and
    LSE to the longer pipeline (only when loads are issued changes), and right."""
    decode_attention, *_ = _lazy()
    k, v, bt, sl = paged([4096, 1000, 3001], 8, 128, 16)
    q = torch.randn(3, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = [decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=4096, return_lse=True,
                             num_splits=8, config=(64, 4, stages))
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
    cu = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
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
    """The combine launched early (PDL) waits for stage 1: same bits as plain launches."""
    from kernels import decode

    k, v, bt, sl = paged([4096, 100, 70000, 1], 8, 128, 16)
    q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    runs = {}
    for on in (True, False):
        decode._USE_PDL = on
        decode._pdl_supported.cache_clear()
        runs[on] = [decode.decode_attention(q, k, v, sl, bt, 0.088, max_seq_len=70000)
                    for _ in range(20)]  # fmt: skip
    decode._USE_PDL = True
    decode._pdl_supported.cache_clear()
    for out in runs[True] + runs[False][1:]:
        assert torch.equal(out, runs[False][0])


def test_write_kv_then_decode_chain():
    """The engine's order, write_kv then decode (stage 1 may start early under PDL and must
    wait for the write): every step sees the token it just wrote."""
    decode_attention, _, write_kv = _lazy()
    bsz, hq, hkv, d, page = 3, 32, 8, 128, 16
    lens = [1000, 17, 5000]
    k, v, bt, sl = paged([n + 12 for n in lens], hkv, d, page)
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    for _ in range(12):
        pos = sl.long()  # the new token's position
        slots = bt.gather(1, (pos // page)[:, None]).squeeze(1).long() * page + pos % page
        k_new = torch.randn(bsz, hkv, d, device="cuda", dtype=torch.bfloat16) * 4
        v_new = torch.randn_like(k_new) * 4
        sl += 1
        q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
        write_kv(k_new, v_new, k, v, slots)  # directly followed by decode's stage 1
        out = decode_attention(q, k, v, sl, bt, d**-0.5, max_seq_len=8192)
        ref = reference.decode_attention(q.float(), k.float(), v.float(), sl, bt, d**-0.5)
        assert_close(out, ref, BF16_TOL, f"chain at {sl.tolist()}")


def test_decode_fused_merge_is_race_free():
    """Many splits per (sequence, KV head), so many programs race for the merge: 30 launches
    give the same bits, match the separate combine kernel, and leave the counters zeroed."""
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
        decode._FUSE_COMBINE = False
        try:
            two = decode_attention(q, k, v, sl, bt, 128**-0.5, max_seq_len=65536,
                                   num_splits=splits)  # fmt: skip
        finally:
            decode._FUSE_COMBINE = True
        assert_close(outs[0], two, 1e-3, f"fused vs combine kernel, {splits} splits")
    torch.cuda.synchronize()
    assert not decode._COUNTERS[q.device].any()
