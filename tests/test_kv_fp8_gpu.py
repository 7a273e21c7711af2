"""The fp8 KV cache on a CUDA GPU (sm_89+): the kernels in bf16 at realistic sizes, decode
under CUDA graphs, and the engine (Triton backend, eager and CUDA graphs) next to a bf16 cache.

Kernel references are kernels/reference.py in float32 (float64 where the queries' range is the
point) on the *dequantized* cache (e4m3 times a bf16 scale is exact in float32), so the
tolerances are the kernels' own rounding: prefill's those of the bf16 kernels over a bf16 cache
(tests/test_kernels_gpu.py), decode's those of its f16 dots (DECODE_TOL). Run on the GPU
machine:
``python3 -m pytest -q tests/test_kv_fp8_gpu.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch
from tensor_checks import assert_close, capture_graph, cu_of

from kernels import reference
from kernels.kv_quant import (
    FP8_KV_DTYPE,
    KV_SCALE_DTYPE,
    dequantize_fp8,
    kv_scale_shape,
    quantize_fp8,
)

pytestmark = pytest.mark.gpu

BF16_TOL = 2e-2  # bf16 operands (p cast to bf16 before P @ V): prefill
# Decode over an fp8 cache runs f16 dots for bf16 queries: q is exact in f16 (times a power of
# two), so are the e4m3 tiles; P rounds to f16 (2^-11 of each value, 4.9e-4) and the bf16 output
# to 2^-9 of each value (2.0e-3 at most, ~1.1e-3 as a norm ratio). 5e-3 holds both with room;
# bf16 operands would need BF16_TOL.
DECODE_TOL = 5e-3
LSE_TOL = 2e-3


class Fp8Pools:
    """Random fp8 pools (from bf16 values whose magnitude varies per token and head) with each
    sequence of ``lens`` in shuffled blocks; the pages wholly left of ``first[b]`` (a sliding
    window's start) are NaN, bytes and scales, and must never be read. ``kd``/``vd``: the
    dequantized pools in float32, what the reference reads."""

    def __init__(self, lens, hkv, d, page, first=None, width=None):
        need = [-(-n // page) for n in lens]
        total = sum(need) + 4
        self.width = width or max(need)
        pools = []
        for _ in range(2):
            x = torch.randn(total, page, hkv, d, device="cuda", dtype=torch.bfloat16)
            mag = torch.empty(total, page, hkv, 1, device="cuda").uniform_(-3, 3).exp()
            q, s = quantize_fp8(x * mag.bfloat16())
            pools.append([q, s.transpose(1, 2).contiguous()])
        ids = torch.randperm(total, device="cuda").int()
        self.bt = torch.zeros(len(lens), self.width, dtype=torch.int32, device="cuda")
        pos = 0
        for b, n in enumerate(need):
            self.bt[b, :n] = ids[pos : pos + n]
            pos += n
            dead = (first[b] if first else 0) // page  # pages wholly left of the window
            for q, s in pools:
                q.view(torch.uint8)[self.bt[b, :dead].long()] = 0x7F  # e4m3 NaN
                s[self.bt[b, :dead].long()] = float("nan")
        (self.k, self.k_scale), (self.v, self.v_scale) = pools
        self.sl = torch.tensor(lens, dtype=torch.int32, device="cuda")

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (dequantize_fp8(self.k, self.k_scale.transpose(1, 2)),
                dequantize_fp8(self.v, self.v_scale.transpose(1, 2)))  # fmt: skip


def rope_tables(d, positions=70000):
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    freqs = torch.arange(positions, device="cuda").float()[:, None] * inv[None, :]
    return freqs.cos().bfloat16(), freqs.sin().bfloat16()


# ---------------------------------------------------------------- kernels


@pytest.mark.parametrize("norms", [False, True], ids=["llama", "qwen3-norms"])
def test_rope_write_kv_fp8_bf16(norms):
    """Llama-3-8B heads, 300 tokens, every 7th a padding slot: the fp8 bytes and scales are
    quantize_fp8 of what the bf16 store writes, and (without head norms) the reference's."""
    from kernels.rope import rope_write_kv

    t, hq, hkv, d, page, n = 300, 32, 8, 128, 16, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 3
    pos = torch.randint(0, 70000, (t,), device="cuda")
    cos, sin = rope_tables(d)
    slots = torch.randperm(n * page, device="cuda")[:t]
    slots[::7] = -1
    kw = {}
    if norms:
        kw = {"q_norm": torch.rand(d, device="cuda").bfloat16() + 0.5,
              "k_norm": torch.rand(d, device="cuda").bfloat16() + 0.5}  # fmt: skip

    def pools():
        cache = torch.zeros(n, page, hkv, d, device="cuda", dtype=FP8_KV_DTYPE)
        scale = torch.zeros(kv_scale_shape(n, page, hkv), device="cuda", dtype=KV_SCALE_DTYPE)
        return cache, cache.clone(), scale, scale.clone()

    mine, ref = pools(), pools()
    bf16 = [torch.zeros(n, page, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    q = rope_write_kv(qkv, pos, cos, sin, mine[0], mine[1], slots, hq, hkv, **kw,
                      k_scale=mine[2], v_scale=mine[3])  # fmt: skip
    assert torch.equal(q, rope_write_kv(qkv, pos, cos, sin, *bf16, slots, hq, hkv, **kw))
    kept = slots[slots >= 0]
    blk, off = kept // page, kept % page
    for cache, scales, x in ((mine[0], mine[2], bf16[0]), (mine[1], mine[3], bf16[1])):
        want_q, want_s = quantize_fp8(x[blk, off])
        assert torch.equal(cache[blk, off].view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(scales[blk, :, off], want_s)
    if not norms:
        reference.rope_write_kv(qkv, pos, cos, sin, ref[0], ref[1], slots, hq, hkv,
                                k_scale=ref[2], v_scale=ref[3])  # fmt: skip
        for a, b in zip(mine, ref):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


DECODE_CASES = [  # (hq, hkv, d, page, lens, window, softcap)
    (32, 8, 128, 16, [32768, 1, 4097, 1000, 17], 0, 0.0),
    (32, 8, 128, 64, [131072 - 5], 0, 0.0),  # Llama-3-8B heads at 128K
    (32, 8, 128, 16, [131072, 70001], 4096, 0.0),
    (16, 8, 256, 16, [32768, 5000], 0, 0.0),
    (16, 8, 256, 16, [131072, 4097, 1000], 1024, 0.0),  # Gemma 3's local layers
    (16, 8, 256, 64, [8192, 300], 4096, 50.0),  # Gemma 2's soft-cap
]


@pytest.mark.parametrize("hq,hkv,d,page,lens,window,softcap", DECODE_CASES)
def test_decode_fp8_bf16(hq, hkv, d, page, lens, window, softcap):
    from kernels.decode import decode_attention

    kv = Fp8Pools(lens, hkv, d, page, [max(0, n - window) if window else 0 for n in lens])
    q = torch.randn(len(lens), hq, d, device="cuda", dtype=torch.bfloat16)
    kd, vd = kv.dequantized()
    ref, ref_lse = reference.decode_attention(q.float(), kd, vd, kv.sl, kv.bt, d**-0.5,
                                              return_lse=True, window=window,
                                              softcap=softcap)  # fmt: skip
    del kd, vd
    for kw in ({}, {"num_splits": 1}, {"split_size": 512}):
        out = torch.full_like(q, float("nan"))
        out, lse = decode_attention(q, kv.k, kv.v, kv.sl, kv.bt, d**-0.5, max_seq_len=max(lens),
                                    out=out, return_lse=True, window=window, softcap=softcap,
                                    **kv.scales, **kw)  # fmt: skip
        assert_close(out, ref, DECODE_TOL, f"fp8 decode {lens} window {window} {kw}")
        assert_close(lse, ref_lse, LSE_TOL, f"fp8 decode lse {lens} {kw}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gain", [1e5, 1.0, 1e-6])
def test_decode_fp8_queries_of_any_range_in_f16(dtype, gain):
    """Queries (bf16 up to ~4e5, past f16's 65,504, or ~4e-6, f16 subnormals; fp16 at 1)
    with the softmax scale divided by the same factor, against float64 on the dequantized
    cache: the f16 dots take q times a power of two and keep DECODE_TOL."""
    from kernels.decode import decode_attention

    if dtype == torch.float16 and gain != 1.0:
        pytest.skip("fp16 queries are already in f16's range")
    hq, hkv, d, page, lens = 32, 8, 128, 16, [8192, 1, 4097, 300]
    kv = Fp8Pools(lens, hkv, d, page)
    q = (torch.randn(len(lens), hq, d, device="cuda") * gain).to(dtype)
    scale = d**-0.5 / gain
    kd, vd = (x.double() for x in kv.dequantized())
    for kw in ({}, {"window": 1000, "softcap": 30.0}):
        ref, ref_lse = reference.decode_attention(q.double(), kd, vd, kv.sl, kv.bt, scale,
                                                  return_lse=True, **kw)  # fmt: skip
        out, lse = decode_attention(q, kv.k, kv.v, kv.sl, kv.bt, scale, max_seq_len=max(lens),
                                    return_lse=True, **kv.scales, **kw)  # fmt: skip
        assert_close(out, ref, DECODE_TOL, f"fp8 decode {dtype} x {gain} {kw}")
        assert_close(lse, ref_lse, LSE_TOL, f"fp8 decode lse {dtype} x {gain} {kw}")


@pytest.mark.parametrize("page", [16, 64])
def test_decode_fp8_every_swept_tile_config(page):
    """Each stage-1 config that ``kernels.bench --kv-dtype fp8 --sweep decode-config`` times
    (FP8_DECODE_CONFIGS) computes the same attention: Llama-3-8B heads, lengths that end
    inside a tile and a page, heuristic splits and one split."""
    from kernels.bench import FP8_DECODE_CONFIGS
    from kernels.decode import DecodeTuning, decode_attention

    lens = [20000, 1, 4097, 131]
    kv = Fp8Pools(lens, 8, 128, page)
    q = torch.randn(len(lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    kd, vd = kv.dequantized()
    ref = reference.decode_attention(q.float(), kd, vd, kv.sl, kv.bt, 128**-0.5)
    for cfg in FP8_DECODE_CONFIGS:
        for kw in ({}, {"num_splits": 1}):
            out = decode_attention(q, kv.k, kv.v, kv.sl, kv.bt, 128**-0.5, max_seq_len=20000,
                                   tuning=DecodeTuning(tiles=cfg), **kv.scales, **kw)  # fmt: skip
            assert_close(out, ref, DECODE_TOL, f"fp8 decode tiles {cfg} page {page} {kw}")


def check_prefill(
    q, qlens, kv: Fp8Pools, dequantized, what: str, window: int = 0, softcap: float = 0.0, **kw
) -> None:
    """Prefill of ``q`` (chunks of ``qlens``) over the fp8 pools ``kv`` into a NaN-filled
    output (unwritten rows fail), output and LSE against the reference on ``dequantized``
    (K, V); ``kw``: the kernel's ``path`` and ``config``."""
    from kernels.prefill import prefill_attention

    d = q.shape[2]
    cu = cu_of(qlens)
    out = torch.full_like(q, float("nan"))
    out, lse = prefill_attention(q, kv.k, kv.v, cu, kv.sl, kv.bt, d**-0.5,
                                 max_query_len=max(qlens), out=out, return_lse=True,
                                 window=window, softcap=softcap, **kv.scales, **kw)  # fmt: skip
    ref, ref_lse = reference.prefill_attention(q.float(), *dequantized, cu, kv.sl, kv.bt,
                                               d**-0.5, return_lse=True, window=window,
                                               softcap=softcap)  # fmt: skip
    assert_close(out, ref, BF16_TOL, what)
    assert_close(lse, ref_lse, LSE_TOL, f"{what}: lse")


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4096, 50.0)])
def test_prefill_fp8_bf16(d, page, window, softcap):
    """Chunks after cached context (a 2K chunk after 30K, a 1-token one, a prompt from
    scratch), fp8 pages under the bf16 prefill tiles."""

    hq, hkv = 16, 8
    qlens, ctx = [2048, 1, 3000, 700], [30000, 5000, 0, 64]
    first = [max(0, c - window + 1) if window else 0 for c in ctx]
    kv = Fp8Pools([a + b for a, b in zip(qlens, ctx)], hkv, d, page, first)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    check_prefill(q, qlens, kv, kv.dequantized(), f"fp8 prefill d={d} page {page} window "
                  f"{window}", window=window, softcap=softcap)  # fmt: skip


# ---- prefill, the Hopper path over an fp8 cache (path="hopper": e4m3 tiles by TMA copies) ----


def _skip_off_sm90():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper prefill path runs on sm_90")


def poison(kv: Fp8Pools, lens, page, first=None) -> None:
    """e4m3 NaN bytes and NaN scales in every slot of each sequence's last page past its end
    and of its first window page left of ``first[b]``: the unmaskable copies bring them in
    with the diagonal's and the window edge's tiles. Dequantize before: the reference reads
    clean pools."""
    for b, n in enumerate(lens):
        spans = [(n // page, n % page, page)] if n % page else []
        if first and first[b] % page:
            spans.append((first[b] // page, 0, first[b] % page))
        for blk, lo, hi in spans:
            blk = kv.bt[b, blk].long()
            for q, s in ((kv.k, kv.k_scale), (kv.v, kv.v_scale)):
                q.view(torch.uint8)[blk, lo:hi] = 0x7F  # e4m3 NaN
                s[blk, :, lo:hi] = float("nan")


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page", [64, 128])
@pytest.mark.parametrize("per_sm", [None, 0])
def test_prefill_hopper_fp8_bf16(d, page, per_sm):
    """The Hopper path over an fp8 cache with its default tiles, persistent (as the default
    has it) and not (0): GQA, five sequences with cached context, one-token chunks, lengths off
    every edge, NaN bytes and scales past each end; output and LSE against the reference
    on the dequantized cache."""
    _skip_off_sm90()
    from kernels.prefill import hopper_config

    hq, hkv = (32, 8) if d == 128 else (16, 4)
    qlens, ctx = [1, 17, 2000, 700, 129], [0, 100, 0, 3000, 64]
    lens = [a + b for a, b in zip(qlens, ctx)]
    kv = Fp8Pools(lens, hkv, d, page)
    kd, vd = kv.dequantized()
    poison(kv, lens, page)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    cfg = hopper_config(d, torch.bfloat16, page, fp8=True)
    cfg = cfg if per_sm is None else (*cfg[:4], per_sm)
    check_prefill(q, qlens, kv, (kd, vd), f"fp8 hopper prefill d={d} page={page} {cfg}",
                  config=cfg, path="hopper")  # fmt: skip


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("page", [64, 128])
def test_prefill_hopper_fp8_window_softcap(d, page):
    """A 4,096-token window and a soft-cap of 50 (Gemma 2's) over an fp8 cache: chunks after
    30K / 5K cached tokens, a one-token chunk; the pages wholly left of each chunk's first
    window are NaN (never read), and so are the slots left of the window in its first page
    and past each end (read, and masked)."""
    _skip_off_sm90()

    hq, hkv, window, softcap = 16, 8, 4096, 50.0
    qlens, ctx = [2048, 1, 3000, 700], [30000, 5000, 0, 64]
    lens = [a + b for a, b in zip(qlens, ctx)]
    first = [max(0, c - window + 1) for c in ctx]
    kv = Fp8Pools(lens, hkv, d, page, first)
    kd, vd = kv.dequantized()
    poison(kv, lens, page, first)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    check_prefill(q, qlens, kv, (kd, vd), f"fp8 hopper window d={d} page={page}",
                  window=window, softcap=softcap, path="hopper")  # fmt: skip


def test_prefill_hopper_fp8_cuda_graph_replay():
    """One capture over an fp8 cache, replays with new block tables, lengths and queries
    (NaN past each new end), each right: the e4m3 descriptors travel by value in the launch
    and the scale pools by pointer."""
    _skip_off_sm90()
    from kernels.prefill import prefill_attention

    bsz, n, hq, hkv, d, page = 2, 1024, 32, 8, 128, 128
    kv = Fp8Pools([3 * n] * bsz, hkv, d, page)  # room for 3n tokens a sequence
    clean = [x.clone() for x in (kv.k, kv.k_scale, kv.v, kv.v_scale)]
    q = torch.randn(bsz * n, hq, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of([n] * bsz)
    kv.bt.zero_()
    kv.sl.fill_(n)

    def call():
        return prefill_attention(q, kv.k, kv.v, cu, kv.sl, kv.bt, d**-0.5, max_query_len=n,
                                 path="hopper", **kv.scales)  # fmt: skip

    graph, out = capture_graph(call)
    for ctx in (0, 700, 2047):  # cached tokens before each chunk of n
        for x, c in zip((kv.k, kv.k_scale, kv.v, kv.v_scale), clean):
            x.copy_(c)
        kv.bt.copy_(torch.randperm(kv.k.shape[0], device="cuda")[: kv.bt.numel()].view_as(kv.bt))
        kv.sl.fill_(ctx + n)
        kd, vd = kv.dequantized()
        poison(kv, [ctx + n] * bsz, page)
        q.copy_(torch.randn_like(q))
        out.fill_(float("nan"))
        graph.replay()
        ref = reference.prefill_attention(q.float(), kd, vd, cu, kv.sl, kv.bt, d**-0.5)
        assert_close(out, ref, BF16_TOL, f"fp8 hopper graph replay ctx={ctx}")


def test_prefill_auto_takes_hopper_over_fp8():
    """``path="auto"`` over an fp8 cache: the Hopper path on sm_90 from 64-token pages on (the
    same bits as ``path="hopper"``; the Gluon kernel refuses fp8), the portable kernel on
    16-token pages and off sm_90."""
    from kernels.prefill import prefill_attention

    sm90 = torch.cuda.get_device_capability()[0] == 9
    for page in (16, 64, 128):
        kv = Fp8Pools([3000], 8, 128, page)
        q = torch.randn(3000, 32, 128, device="cuda", dtype=torch.bfloat16)
        args = (q, kv.k, kv.v, cu_of([3000]), kv.sl, kv.bt, 0.088)
        auto = prefill_attention(*args, max_query_len=3000, path="auto", **kv.scales)
        picked = "hopper" if sm90 and page >= 64 else "portable"
        same = prefill_attention(*args, max_query_len=3000, path=picked, **kv.scales)
        assert torch.equal(auto, same), (page, picked)


def _skip_without_gluon():
    import triton

    from kernels.prefill_paths import gluon_triton_refusal

    _skip_off_sm90()
    if gluon_triton_refusal(triton.__version__):
        pytest.skip(gluon_triton_refusal(triton.__version__))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page,head_major", [(128, True), (64, False)])
def test_prefill_auto_over_fp8_runs_gluon_on_the_dequantized_pages(d, page, head_major,
                                                                   monkeypatch):  # fmt: skip
    """``path="auto"`` over an fp8 cache with ``fp8_scratch``: the pages dequantized into the
    scratch and the Gluon kernel reading it (the engine's default on sm_90: 128-token pages of
    a head's rows together), GQA, chunks after cached context, a 1-token chunk, NaN bytes and
    scales past each end, the scratch NaN where nothing is written; output and LSE against the
    reference on the dequantized cache. With a scratch one page short of the batch's, the batch
    in two groups (two Gluon calls); one page short of a sequence's, the Hopper path over the
    fp8 cache (no Gluon call): the same answer within the tolerance."""
    from kernels import prefill_gluon
    from kernels.kv_quant import new_kv_pool

    _skip_without_gluon()
    hq, hkv = (32, 8) if d == 128 else (16, 4)
    qlens, ctx = [2048, 1, 700, 300], [6000, 5000, 0, 64]
    lens = [a + b for a, b in zip(qlens, ctx)]
    kv = Fp8Pools(lens, hkv, d, page)
    if head_major:
        for name in ("k", "v"):
            pool = getattr(kv, name)
            hm = new_kv_pool(*pool.shape, pool.dtype, pool.device, head_major=True)
            hm.view(torch.uint8).copy_(pool.view(torch.uint8))
            setattr(kv, name, hm)
    kd, vd = kv.dequantized()
    poison(kv, lens, page)
    pages = max(-(-n // page) for n in lens)
    scratch = tuple(torch.full((len(lens) * pages, page, hkv, d), float("nan"),
                               dtype=torch.bfloat16, device="cuda") for _ in range(2))  # fmt: skip
    called = []
    run = prefill_gluon.gluon_prefill

    def spy(q, k, v, *args):
        called.append(k.data_ptr() == scratch[0].data_ptr())
        return run(q, k, v, *args)

    monkeypatch.setattr(prefill_gluon, "gluon_prefill", spy)
    q = torch.randn(sum(qlens), hq, d, device="cuda", dtype=torch.bfloat16)
    what = f"fp8 auto prefill over dequantized pages d={d} page={page}"
    check_prefill(q, qlens, kv, (kd, vd), what, path="auto", fp8_scratch=scratch,
                  max_seq_len=max(lens))  # fmt: skip
    assert called == [True]
    short = tuple(x[: len(lens) * pages - 1] for x in scratch)
    check_prefill(q, qlens, kv, (kd, vd), f"{what}, in groups", path="auto",
                  fp8_scratch=short, max_seq_len=max(lens))  # fmt: skip
    assert called == [True] * 3
    tiny = tuple(x[: pages - 1] for x in scratch)
    check_prefill(q, qlens, kv, (kd, vd), f"{what}, scratch too short", path="auto",
                  fp8_scratch=tiny, max_seq_len=max(lens))  # fmt: skip
    assert called == [True] * 3


@pytest.mark.parametrize("d", [64, 128, 256])
def test_prefill_hopper_fp8_sweep_configs_are_right(d):
    """Every config ``kernels.bench --sweep hopper --kv-dtype fp8`` times (HOPPER_CONFIGS and
    HOPPER_FP8_CONFIGS) compiles, fits and computes the right thing over an fp8 cache."""
    _skip_off_sm90()
    from kernels.bench import HOPPER_CONFIGS, HOPPER_FP8_CONFIGS
    from kernels.prefill import prefill_attention

    qlens, ctx = [1000, 300], [0, 1500]
    lens = [a + b for a, b in zip(qlens, ctx)]
    kv = Fp8Pools(lens, 8, d, 128)
    q = torch.randn(sum(qlens), 32, d, device="cuda", dtype=torch.bfloat16)
    cu = cu_of(qlens)
    kd, vd = kv.dequantized()
    ref = reference.prefill_attention(q.float(), kd, vd, cu, kv.sl, kv.bt, d**-0.5)
    for cfg in HOPPER_CONFIGS[d] + HOPPER_FP8_CONFIGS[d]:
        out = prefill_attention(q, kv.k, kv.v, cu, kv.sl, kv.bt, d**-0.5, max_query_len=1000,
                                config=cfg, path="hopper", **kv.scales)  # fmt: skip
        assert_close(out, ref, BF16_TOL, f"fp8 hopper d={d} {cfg}")


def test_decode_fp8_cuda_graph_replay():
    """A windowed soft-capped layer (head dim 256) and a global one over fp8 caches in one
    graph captured at max_seq_len 32K, replayed with new lengths, block tables and queries."""
    from kernels.decode import decode_attention

    bsz, hq, hkv, d, page, max_len = 4, 16, 8, 256, 16, 32768
    pools = [Fp8Pools([max_len] * bsz, hkv, d, page) for _ in range(2)]
    q = torch.randn(bsz, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.zeros(bsz, max_len // page, dtype=torch.int32, device="cuda")
    sl = torch.ones(bsz, dtype=torch.int32, device="cuda")
    layers = [{"window": 4096, "softcap": 50.0}, {}]

    def step():
        return [decode_attention(q, p.k, p.v, sl, bt, d**-0.5, max_seq_len=max_len, **p.scales,
                                 **kw) for p, kw in zip(pools, layers)]  # fmt: skip

    graph, outs = capture_graph(step)
    n_blocks = pools[0].k.shape[0]
    for lens in ([1, 32768, 4096, 4097], [5000, 64, 30001, 8000], [2, 3, 4, 1]):
        bt.copy_(torch.randperm(n_blocks, device="cuda")[: bsz * bt.shape[1]].view_as(bt))
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        for p, kw, o in zip(pools, layers, outs):
            kd, vd = p.dequantized()
            ref = reference.decode_attention(q.float(), kd, vd, sl, bt, d**-0.5, **kw)
            assert_close(o, ref, DECODE_TOL, f"fp8 graph replay {kw} {lens}")


@pytest.mark.parametrize("chain", [True, False])
def test_rope_write_kv_fp8_then_decode(chain):
    """The engine's order over an fp8 cache (stage 1 may start early under PDL and must wait
    for the store): every step reads the token it just quantized."""
    from kernels.decode import decode_attention
    from kernels.rope import rope_write_kv

    bsz, hq, hkv, d, page = 3, 32, 8, 128, 16
    lens = [1000, 17, 5000]
    kv = Fp8Pools([n + 12 for n in lens], hkv, d, page)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cos, sin = rope_tables(d)
    for _ in range(12):
        pos = sl.long()
        slots = kv.bt.gather(1, (pos // page)[:, None]).squeeze(1).long() * page + pos % page
        qkv = torch.randn(bsz, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16) * 4
        sl += 1
        q = rope_write_kv(qkv, pos, cos, sin, kv.k, kv.v, slots, hq, hkv, chain=chain,
                          **kv.scales)  # fmt: skip
        out = decode_attention(q, kv.k, kv.v, sl, kv.bt, d**-0.5, max_seq_len=8192, chain=chain,
                               **kv.scales)  # fmt: skip
        kd, vd = kv.dequantized()
        ref = reference.decode_attention(q.float(), kd, vd, sl, kv.bt, d**-0.5)
        assert_close(out, ref, DECODE_TOL, f"chain={chain} at {sl.tolist()}")


# ---------------------------------------------------------------- the engine

GREEDY_TOKENS = 24
BF16_LOGIT_SLACK = 0.5  # logits near 25 have a bf16 spacing of 0.125 (test_engine_gpu.py)
# the fp8 cache's own choices: on the CPU (float32) each fp8 greedy token is within 0.42 of the
# float32 cache's top logit (tests/test_kv_fp8_engine.py allows 1.0); plus bf16's slack
FP8_LOGIT_SLACK = 1.0 + BF16_LOGIT_SLACK


@pytest.fixture(scope="module")
def prompts():
    from flashserve.bench.accuracy import _prompt_ids
    from flashserve.bench.accuracy import prompts as fixed
    from flashserve.loaders.load import default_model_path
    from flashserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_model_path())
    return [_prompt_ids(tok, t) for t in fixed(10)]


def _llm(**kwargs):
    from flashserve.config import EngineConfig
    from flashserve.engine.llm_engine import LLM

    return LLM(EngineConfig(max_model_len=4096, max_kv_tokens=1 << 16, **kwargs))


def _release(llm) -> None:
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _gaps(llm, prompts, outputs) -> torch.Tensor:
    """Teacher forcing of each prompt and its ``outputs`` through ``llm``: how far below its
    top logit each output token is (0 where it is the argmax)."""
    gaps = []
    for prompt, tokens in zip(prompts, outputs):
        logits = torch.cat(list(llm.engine.prompt_logits(prompt + tokens)))[len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        gaps.append((logits.max(dim=1).values - chosen).cpu())
    return torch.cat(gaps)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_fp8_triton_engine_tokens_are_the_torch_fp8_engines_choices(prompts, enforce_eager):
    """The same fp8 cache format (rope_write_kv quantizes as the reference does) written and
    read by the Triton kernels and by the torch backend: the Triton engine's tokens are the
    torch engine's choices within rounding. bf16 rounding differences of the K/V (an ulp,
    2^-8) move an element across an e4m3 rounding boundary (steps of 2^-3) about 3% of the
    time, so the fp8 slack applies, not bf16's alone. On sm_90 under Triton 3.6 the prompts
    prefill through the Gluon kernel over dequantized pages (the runner's scratch)."""
    import triton

    from flashserve.sampling.params import SamplingParams
    from kernels.prefill_paths import gluon_triton_refusal

    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    llm = _llm(attention_backend="triton", enforce_eager=enforce_eager, kv_cache_dtype="fp8")
    gluon = torch.cuda.get_device_capability() == (9, 0) and not gluon_triton_refusal(
        triton.__version__
    )
    assert (llm.engine.runner.fp8_prefill_scratch is not None) == gluon
    outputs = [c.token_ids for c in llm.generate(prompts, params)]
    _release(llm)
    ref = _llm(attention_backend="torch", enforce_eager=True, kv_cache_dtype="fp8")
    gap = _gaps(ref, prompts, outputs)
    _release(ref)
    assert (gap == 0).float().mean() >= 0.9 and gap.max() <= FP8_LOGIT_SLACK, gap.tolist()


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_fp8_triton_engine_tokens_are_close_to_bf16_kv(prompts, enforce_eager):
    """Triton, bf16 activations: the fp8 cache's greedy tokens, teacher-forced through the
    engine with a bf16 cache, are its argmax at 85% of the positions or more and otherwise
    near ties (CPU, float32: 96.5%, gaps up to 0.42)."""
    from flashserve.sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=GREEDY_TOKENS, temperature=0, ignore_eos=True)
    llm = _llm(attention_backend="triton", enforce_eager=enforce_eager, kv_cache_dtype="fp8")
    outputs = [c.token_ids for c in llm.generate(prompts, params)]
    assert llm.engine.runner.kv_caches[0][0].dtype == FP8_KV_DTYPE
    _release(llm)
    ref = _llm(attention_backend="triton", enforce_eager=True)
    gap = _gaps(ref, prompts, outputs)
    _release(ref)
    assert (gap == 0).float().mean() >= 0.85 and gap.max() <= FP8_LOGIT_SLACK, gap.tolist()


def test_fp8_prefix_caching_on_and_off_under_cuda_graphs():
    """Triton kernels under CUDA graphs, float32 activations (exact argmax ties aside, the
    tokens do not depend on rounding), fp8 cache (on sm_90 its default 128-token blocks, a
    head's rows together): caching on and off give the same tokens."""
    import random

    from flashserve.config import EngineConfig
    from flashserve.engine.llm_engine import LLM
    from flashserve.sampling.params import SamplingParams

    head = [random.randrange(3, 500) for _ in range(300)]  # two whole 128-token blocks
    waves = [[head + [7, 8, 9]], [head + [random.randrange(3, 500)] for _ in range(4)]]
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    out = {}
    for caching in (False, True):
        llm = LLM(EngineConfig(model="dummy:tiny", dtype="float32", kv_cache_dtype="fp8",
                               max_kv_tokens=4096, enable_prefix_caching=caching))  # fmt: skip
        out[caching] = [[c.token_ids for c in llm.generate(w, params)] for w in waves]
        if caching:
            assert llm.engine.scheduler.prefix_cache_hits >= 2 * llm.engine.config.block_size
        _release(llm)
    assert out[True] == out[False]
