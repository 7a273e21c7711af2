"""The fp8 KV cache's kernels (kernels.kv_quant): quantization where K/V are written, and the
decode and prefill kernels reading e4m3 pages with their per-(token, KV head) scales.

The attention kernels are checked against the float64 reference applied to the *dequantized*
cache (``q * scale``, exact in float64), so what is tested is the kernel, not the quantization
error: their tolerances are those of the same kernels over an fp16/fp32 cache. The quantizers
(Triton's in ``rope_write_kv``, torch's in ``reference.write_kv``) must agree byte for byte,
and the round trip must stay within e4m3's bound. Interpreter sizes; long contexts are in
tests/test_kv_fp8_gpu.py. Decode over an fp8 cache runs its dots in f16 for bf16 and fp16
queries alike (no bf16 ``tl.dot``, which the interpreter miscomputes), so its bf16 queries are
tested here too; prefill's bf16 dots are tested on the GPU.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from tensor_checks import assert_close, cu_of, head_major_copy  # noqa: E402

from kernels import reference  # noqa: E402
from kernels.decode import DecodeTuning, decode_attention, scales_ahead  # noqa: E402
from kernels.kv_quant import (  # noqa: E402
    FP8_KV_DTYPE,
    FP8_MAX,
    KV_SCALE_DTYPE,
    dequantize_fp8,
    head_major_pages,
    is_head_major,
    kv_scale_shape,
    new_kv_pool,
    quantize_fp8,
)
from kernels.prefill import prefill_attention  # noqa: E402
from kernels.rope import rope_write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the fp16/fp32 cache tolerances of tests/test_kernels.py: the dequantized cache is exact. bf16
# queries (decode's f16 dots): the bf16 output's rounding, which the interpreter does by
# truncation (up to 2^-8 of each value; measured 2-3e-3), over f16's (P to 2^-11)
TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 8e-3}
LSE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-3}
E4M3_REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: rounding moves a normal value by <= 2^-4 of it


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, for exact comparisons that NaN poison and -0 do not confuse."""
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


class Fp8Paged:
    """A random fp8 paged cache holding ``lens[b]`` tokens per sequence in shuffled blocks,
    quantized from random values whose magnitude varies per (token, head) by a factor of
    ``e^+-spread`` (the scales matter), times ``gain``; ``kd``/``vd`` are its dequantized
    float64 pools, what the reference reads."""

    def __init__(self, lens, hkv, d, page, spare_blocks=3, spread=4.6, gain=1.0):
        self.lens, self.page = list(lens), page
        need = [-(-n // page) for n in self.lens]
        total = sum(need) + spare_blocks
        pools = []
        for _ in range(2):
            x = torch.randn(total, page, hkv, d, device=DEVICE) * gain
            mag = torch.empty(total, page, hkv, 1, device=DEVICE).uniform_(-spread, spread)
            q, s = quantize_fp8(x * mag.exp())  # [N, BS, Hkv, D], [N, BS, Hkv]
            pools.append((q, s.transpose(1, 2).contiguous()))
        (self.k, self.k_scale), (self.v, self.v_scale) = pools
        self.kd = dequantize_fp8(self.k, self.k_scale.transpose(1, 2), torch.float64)
        self.vd = dequantize_fp8(self.v, self.v_scale.transpose(1, 2), torch.float64)
        ids = torch.randperm(total)
        self.block_tables = torch.zeros(len(lens), max(max(need), 1) + 1, dtype=torch.int32)
        pos = 0
        for b, n in enumerate(need):
            self.block_tables[b, :n] = ids[pos : pos + n].int()
            pos += n
        self.block_tables = self.block_tables.to(DEVICE)
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=DEVICE)

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


# ---------------------------------------------------------------- quantization


def test_quantize_round_trip_is_within_the_e4m3_bound():
    """Per row: scale = bf16(amax / 448), |q| <= 448 with the amax at or next to 448, and each
    element back within 2^-4 of itself (normal e4m3 range) or half of the subnormal step
    2^-9 * scale; an all-zero row gives zeros."""
    x = torch.randn(64, 4, 96) * torch.exp(torch.empty(64, 4, 1).uniform_(-9, 9))
    x[3, 1] = 0.0
    x[5, 2, :7] = torch.tensor([1e4, -1e-6, 0.0, -0.0, 3e-3, 448.0, -5.0])
    q, scale = quantize_fp8(x)
    assert q.dtype == FP8_KV_DTYPE and scale.dtype == KV_SCALE_DTYPE and scale.shape == (64, 4)
    amax = x.abs().amax(-1)
    torch.testing.assert_close(scale, (amax.clamp_min(2.0**-64) / FP8_MAX).to(KV_SCALE_DTYPE))
    qf = q.float()
    assert qf.abs().max() <= FP8_MAX and not torch.isnan(qf).any()
    top = qf.abs().amax(-1)[amax > 0]
    assert (top == FP8_MAX).all(), "each row's amax lands on 448 (within a bf16 scale's 2^-9)"
    y = x / scale.float()[..., None]  # the value q rounds
    err = (qf - y.clamp(-FP8_MAX, FP8_MAX)).abs()
    normal = y.abs() >= 2.0**-6
    assert (err[normal] <= E4M3_REL * y.abs()[normal]).all()
    assert (err[~normal] <= 2.0**-10).all()
    back = dequantize_fp8(q, scale)
    assert (back[3, 1] == 0).all()
    rel = ((back - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[amax > 0]
    assert rel.max() <= E4M3_REL, f"worst row {rel.max():.3e}"


def test_reference_write_kv_quantizes_at_the_slots_and_skips_padding():
    n, bs, hkv, d = 5, 8, 2, 16
    k_cache = torch.full((n, bs, hkv, d), float("nan")).to(FP8_KV_DTYPE)
    v_cache = k_cache.clone()
    k_scale = torch.full(kv_scale_shape(n, bs, hkv), float("nan"), dtype=KV_SCALE_DTYPE)
    v_scale = k_scale.clone()
    before = [_bytes(t).clone() for t in (k_cache, v_cache, k_scale, v_scale)]
    k, v = torch.randn(3, hkv, d) * 5, torch.randn(3, hkv, d)
    slots = torch.tensor([9, -1, 37])
    reference.write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize_fp8(x[[0, 2]])
        for row, slot in enumerate((9, 37)):
            blk, off = divmod(slot, bs)
            assert torch.equal(_bytes(cache[blk, off]), _bytes(q[row]))
            assert torch.equal(_bytes(scales[blk, :, off]), _bytes(s[row]))
    written = torch.zeros(n * bs, dtype=torch.bool)
    written[[9, 37]] = True
    for t, old in zip((k_cache, v_cache), before[:2]):
        flat, flat_old = _bytes(t).view(n * bs, -1), old.view(n * bs, -1)
        assert torch.equal(flat[~written], flat_old[~written]), "an untouched slot changed"
    for t, old in zip((k_scale, v_scale), before[2:]):
        flat, flat_old = _bytes(t).transpose(1, 2).reshape(n * bs, hkv), old.transpose(1, 2)
        assert torch.equal(flat[~written], flat_old.reshape(n * bs, hkv)[~written])


ROPE_CASES = [  # (dtype, hq, hkv, d, rotated dims, head norms)
    (torch.float16, 4, 2, 64, 64, False),
    (torch.float32, 6, 2, 128, 128, False),
    (torch.float16, 3, 1, 96, 96, True),  # a head dim that is not a power of two, Qwen3's norms
    (torch.float32, 4, 4, 64, 32, False),  # partial rotary: dims 32..63 pass through
]


@pytest.mark.parametrize("dtype,hq,hkv,d,rot,norms", ROPE_CASES)
def test_rope_write_kv_fp8_bytes_equal_the_reference(dtype, hq, hkv, d, rot, norms):
    """The kernel's fp8 bytes and bf16 scales are exactly ``quantize_fp8`` of the K/V it
    stores in an fp16/fp32 cache (both divide by the stored scale, correctly rounded, and round
    to nearest even), and without head norms exactly the reference's (with them the normed
    keys may differ from torch's by an ulp: tests/test_layer_kernels.py); untouched slots keep
    their NaN poison; the rotated queries do not depend on the cache's dtype."""
    t, n, bs = 9, 6, 16
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE) * 4).to(dtype)
    qkv[0, hq * d : (hq + 1) * d] = 0  # a zero key head: the amax floor
    qkv[1, (hq + hkv) * d] = 3e4 if dtype == torch.float16 else 1e6  # an outlier value
    pos = torch.randint(0, 200, (t,), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEVICE) / rot))
    ang = torch.arange(256, device=DEVICE)[:, None] * inv[None]
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    slots = torch.randperm(n * bs, device=DEVICE)[:t]
    slots[4] = -1  # a CUDA-graph padding token: stored nowhere
    kw = {}
    if norms:
        w = lambda: (1 + 0.1 * torch.randn(d, device=DEVICE)).to(dtype)  # noqa: E731
        kw = {"q_norm": w(), "k_norm": w()}

    def pools():
        cache = torch.full((n, bs, hkv, d), float("nan"), device=DEVICE).to(FP8_KV_DTYPE)
        scale = torch.full(kv_scale_shape(n, bs, hkv), float("nan"), device=DEVICE)
        return cache, cache.clone(), scale.to(KV_SCALE_DTYPE), scale.to(KV_SCALE_DTYPE)

    mine, ref = pools(), pools()
    q = rope_write_kv(qkv, pos, cos, sin, mine[0], mine[1], slots, hq, hkv, **kw,
                      k_scale=mine[2], v_scale=mine[3])  # fmt: skip
    q_ref = reference.rope_write_kv(qkv, pos, cos, sin, ref[0], ref[1], slots, hq, hkv, **kw,
                                    k_scale=ref[2], v_scale=ref[3])  # fmt: skip
    plain = [torch.empty(n, bs, hkv, d, device=DEVICE, dtype=dtype) for _ in range(2)]
    q_plain = rope_write_kv(qkv, pos, cos, sin, *plain, slots, hq, hkv, **kw)
    assert torch.equal(q, q_plain)
    kept = slots[slots >= 0]
    blk, off = kept // bs, kept % bs
    for name, cache, scales, x in (("k", mine[0], mine[2], plain[0]),
                                   ("v", mine[1], mine[3], plain[1])):  # fmt: skip
        want_q, want_s = quantize_fp8(x[blk, off])  # [T', Hkv, D], [T', Hkv]
        diff = (_bytes(cache[blk, off]) != _bytes(want_q)).nonzero()
        assert diff.numel() == 0, f"{name}: {len(diff)} bytes differ, first at {diff[0].tolist()}"
        assert torch.equal(_bytes(scales[blk, :, off]), _bytes(want_s)), f"{name} scales"
    if not norms:
        assert torch.equal(q, q_ref)
        for name, a, b in zip(("k", "v", "k_scale", "v_scale"), mine, ref):
            assert torch.equal(_bytes(a), _bytes(b)), f"{name} differs from the reference's"
    poisoned = torch.ones(n * bs, dtype=torch.bool, device=DEVICE)
    poisoned[slots[slots >= 0]] = False
    assert torch.isnan(mine[0].float().view(n * bs, -1)[poisoned]).all()
    assert torch.isnan(mine[3].float().transpose(1, 2).reshape(n * bs, hkv)[poisoned]).all()
    assert not torch.isnan(mine[0].float().view(n * bs, -1)[~poisoned]).any()


# ---------------------------------------------------------------- attention


def _decode(q, kv: Fp8Paged, scale, **kw):
    out = torch.full_like(q, float("nan"))
    return decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, scale,
                            max_seq_len=max(kv.lens), out=out, return_lse=True, **kv.scales,
                            **kw)  # fmt: skip


def _decode_ref(q, kv: Fp8Paged, scale, **kw):
    return reference.decode_attention(q.double(), kv.kd, kv.vd, kv.seq_lens, kv.block_tables,
                                      scale, return_lse=True, **kw)  # fmt: skip


DECODE_CASES = [  # (dtype, hq, hkv, d, lens, page, call options)
    (torch.float16, 4, 4, 64, [1, 17, 1000, 130], 16, {}),
    (torch.float32, 6, 2, 64, [17, 1, 300], 64, {}),
    (torch.float16, 8, 2, 128, [1000, 1, 63], 16, {"num_splits": 1}),
    (torch.float16, 8, 2, 128, [1000, 1, 63], 64, {"num_splits": 7}),
    (torch.float32, 4, 1, 64, [129, 1, 700], 16, {"split_size": 128}),
    (torch.float16, 6, 2, 96, [77, 300], 16, {"window": 50}),
    (torch.float16, 4, 2, 64, [1, 500, 90], 64, {"window": 128, "softcap": 5.0}),
    (torch.float32, 4, 2, 64, [33, 400], 16, {"softcap": 2.0}),
    # bf16 queries: the f16 dots of a bf16 model
    (torch.bfloat16, 8, 2, 128, [1000, 1, 63], 16, {"num_splits": 3}),
    (torch.bfloat16, 8, 2, 128, [700, 129], 64, {}),
    (torch.bfloat16, 4, 2, 64, [1, 500, 90], 64, {"window": 128, "softcap": 5.0}),
    (torch.bfloat16, 6, 2, 96, [77, 300], 16, {"window": 50, "num_splits": 4}),
    (torch.bfloat16, 4, 1, 256, [40, 300], 64, {"softcap": 10.0}),
    (torch.float16, 4, 1, 64, [129, 1, 700], 16, {"split_size": 256}),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,lens,page,kw", DECODE_CASES)
def test_decode_fp8_matches_the_reference_on_the_dequantized_cache(dtype, hq, hkv, d, lens,
                                                                   page, kw):  # fmt: skip
    kv = Fp8Paged(lens, hkv, d, page)
    q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
    out, lse = _decode(q, kv, d**-0.5, **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("window", "softcap")}
    ref_out, ref_lse = _decode_ref(q, kv, d**-0.5, **ref_kw)
    assert_close(out, ref_out, TOL[dtype], f"fp8 decode out {kw}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"fp8 decode lse {kw}")


AHEAD_CASES = [  # (tiles, dtype, d, lens, page, call options): one scale a thread per tile
    ((128, 4, 3), torch.float16, 128, [1000, 1, 300], 16, {}),
    ((128, 4, 2), torch.bfloat16, 64, [700, 129, 2], 64, {"num_splits": 3}),
    ((128, 4, 3), torch.float16, 64, [77, 300], 16, {"window": 50, "softcap": 5.0}),
    ((256, 8, 2), torch.float16, 64, [1000, 255, 17], 16, {"num_splits": 2}),
    ((128, 4, 3), torch.float32, 64, [129, 1, 700], 256, {"split_size": 256}),
]


@pytest.mark.parametrize("tiles,dtype,d,lens,page,kw", AHEAD_CASES)
def test_decode_fp8_scales_loaded_a_tile_ahead(tiles, dtype, d, lens, page, kw):
    """Tiles of one scale a thread (``scales_ahead``: the kernel loads each tile's scales a
    tile ahead itself, across pages and splits, past the end and under windows) compute the
    same attention; 256-token tiles over 16-token pages take 16 block-table entries a tile."""
    assert scales_ahead(True, *tiles[:2])
    kv = Fp8Paged(lens, 2, d, page)
    q = torch.randn(len(lens), 8, d, device=DEVICE).to(dtype)
    out, lse = _decode(q, kv, d**-0.5, tuning=DecodeTuning(tiles=tiles), **kw)
    ref_kw = {k: v for k, v in kw.items() if k in ("window", "softcap")}
    ref_out, ref_lse = _decode_ref(q, kv, d**-0.5, **ref_kw)
    assert_close(out, ref_out, TOL[dtype], f"fp8 decode out {tiles} {kw}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"fp8 decode lse {tiles} {kw}")


def test_decode_fp8_split_equals_unsplit():
    kv = Fp8Paged([1000, 17, 1, 256], 2, 64, 16)
    q = torch.randn(4, 8, 64, device=DEVICE, dtype=torch.float16)
    one, lse1 = _decode(q, kv, 0.125, num_splits=1)
    for kw in ({"num_splits": 7}, {"num_splits": 40}):
        many, lse_many = _decode(q, kv, 0.125, **kw)
        assert_close(many, one, 2e-3, f"split {kw} vs unsplit")
        assert_close(lse_many, lse1, 1e-4, f"split {kw} vs unsplit lse")


def _prefill(q, kv: Fp8Paged, cu, scale, **kw):
    out = torch.full_like(q, float("nan"))
    qlens = (cu[1:] - cu[:-1]).tolist()
    return prefill_attention(q, kv.k, kv.v, cu, kv.seq_lens, kv.block_tables, scale,
                             max_query_len=max(qlens), out=out, return_lse=True, **kv.scales,
                             **kw)  # fmt: skip


PREFILL_CASES = [  # (dtype, hq, hkv, d, query lens, cached context, page, call options)
    (torch.float16, 4, 2, 64, [1, 17, 70], [0, 30, 9], 16, {}),
    (torch.float32, 4, 1, 64, [40, 3], [100, 0], 64, {}),
    (torch.float16, 6, 2, 96, [33, 64], [50, 0], 16, {"window": 20}),
    (torch.float16, 4, 2, 64, [50, 1], [70, 31], 64, {"softcap": 5.0, "window": 40}),
    (torch.float32, 2, 2, 64, [65], [0], 16, {"softcap": 3.0}),
    # bf16 queries: f16 dots here too (common.f16_queries), so the interpreter can run them
    (torch.bfloat16, 4, 2, 64, [40, 9], [25, 60], 16, {"window": 30}),
    (torch.bfloat16, 8, 2, 128, [70], [0], 64, {}),
]


@pytest.mark.parametrize("dtype,hq,hkv,d,qlens,ctx,page,kw", PREFILL_CASES)
def test_prefill_fp8_matches_the_reference_on_the_dequantized_cache(dtype, hq, hkv, d, qlens,
                                                                    ctx, page, kw):  # fmt: skip
    """Chunks over cached context (chunked prefill, prefix reuse) read fp8 pages too."""
    kv = Fp8Paged([a + b for a, b in zip(qlens, ctx)], hkv, d, page)
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    cu = cu_of(qlens)
    out, lse = _prefill(q, kv, cu, d**-0.5, **kw)
    ref_out, ref_lse = reference.prefill_attention(q.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                                   kv.block_tables, d**-0.5, return_lse=True,
                                                   **kw)  # fmt: skip
    assert_close(out, ref_out, TOL[dtype], f"fp8 prefill out {kw}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"fp8 prefill lse {kw}")


# ---------------------------------------------------------------- prefill, the Hopper path
# path="hopper" over an fp8 cache: e4m3 tiles through tensor descriptors (in the interpreter,
# plain Python), their scales beside them. The copies cannot be masked, so every slot past each
# sequence's end (and left of a window in its first page) is NaN, bytes and scales: the kernel
# must not let them in. The interpreter converts e4m3 NaN bytes to 480 (Triton 3.9): here the
# NaN scales are the test, the NaN bytes tests/test_kv_fp8_gpu.py's. Tiles of 32 queries over
# 4 persistent programs (the interpreter's num_sms) give several waves; config None:
# hopper_config's (float32: its small tiles).

E4M3_NAN = 0x7F


def _poisoned(kv: Fp8Paged, starts=None) -> Fp8Paged:
    """``kv`` with e4m3 NaN bytes and NaN scales in every slot of its sequences' pages before
    ``starts[b]`` (0: none) and from ``lens[b]`` on (``kd``/``vd`` keep the clean values)."""
    bad = Fp8Paged.__new__(Fp8Paged)
    bad.__dict__.update(kv.__dict__)
    pools = [x.clone() for x in (kv.k, kv.k_scale, kv.v, kv.v_scale)]
    for b, n in enumerate(kv.lens):
        pages = -(-n // kv.page)
        dead = torch.ones(pages * kv.page, dtype=torch.bool)
        dead[(starts[b] if starts else 0) : n] = False
        for i in dead.nonzero()[:, 0].tolist():
            blk, off = kv.block_tables[b, i // kv.page].long(), i % kv.page
            for cache, scale in (pools[:2], pools[2:]):
                cache.view(torch.uint8)[blk, off] = E4M3_NAN
                scale[blk, :, off] = float("nan")
    bad.k, bad.k_scale, bad.v, bad.v_scale = pools
    return bad


HOPPER_CASES = [  # (dtype, hq, hkv, d, query lens, cached context, page, config, call options)
    (torch.float16, 4, 2, 64, [1, 17, 70], [0, 30, 90], 64, (32, 32, 4, 1, 1), {}),
    (torch.float16, 8, 2, 128, [40, 1, 64], [100, 127, 64], 128, (32, 64, 4, 1, 0), {}),
    (torch.float32, 4, 1, 64, [33, 2], [64, 200], 64, None, {}),
    (torch.float16, 4, 2, 64, [50, 1, 20], [70, 31, 200], 64, (32, 32, 4, 1, 2),
     {"softcap": 5.0, "window": 40}),
    (torch.float16, 2, 1, 256, [20, 3], [45, 61], 64, (16, 32, 4, 1, 1), {"window": 30}),
]  # fmt: skip


@pytest.mark.parametrize("dtype,hq,hkv,d,qlens,ctx,page,cfg,kw", HOPPER_CASES)
def test_prefill_hopper_fp8_matches_the_reference(dtype, hq, hkv, d, qlens, ctx, page, cfg, kw):
    """GQA, chunks after cached context (lengths ending inside a page, on a tile edge, one
    token), the LSE; persistent and not; windows and soft-caps; NaN in every dead slot."""
    kv = Fp8Paged([a + b for a, b in zip(qlens, ctx)], hkv, d, page)
    window = kw.get("window", 0)
    starts = [max(0, c - window + 1) if window else 0 for c in ctx]  # the first chunk query's
    q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
    cu = cu_of(qlens)
    out, lse = _prefill(q, _poisoned(kv, starts), cu, d**-0.5, path="hopper", config=cfg, **kw)
    ref_out, ref_lse = reference.prefill_attention(q.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                                   kv.block_tables, d**-0.5, return_lse=True,
                                                   **kw)  # fmt: skip
    assert_close(out, ref_out, TOL[dtype], f"fp8 hopper prefill out {cfg} {kw}")
    assert_close(lse, ref_lse, LSE_TOL[dtype], f"fp8 hopper prefill lse {cfg} {kw}")


def test_prefill_hopper_fp8_chunks_equal_the_whole_prompt():
    """Chunked prefill on the Hopper path over an fp8 cache (the engine's order: each chunk
    sees the pages written so far, the rest of its last page NaN) equals the whole prompt."""
    n, page, cfg = 200, 64, (32, 64, 4, 1, 1)
    kv = Fp8Paged([n], 2, 64, page)
    q = torch.randn(n, 4, 64, device=DEVICE).half()
    whole, whole_lse = _prefill(q, _poisoned(kv), cu_of([n]), 0.125, path="hopper", config=cfg)
    parts = []
    for a, b in ((0, 64), (64, 130), (130, 131), (131, n)):
        chunk = Fp8Paged.__new__(Fp8Paged)
        chunk.__dict__.update(kv.__dict__)
        chunk.lens, chunk.seq_lens = [b], torch.tensor([b], dtype=torch.int32, device=DEVICE)
        parts.append(_prefill(q[a:b], _poisoned(chunk), cu_of([b - a]), 0.125, path="hopper",
                              config=cfg))  # fmt: skip
    assert_close(torch.cat([o for o, _ in parts]), whole, 2e-3, "fp8 hopper chunks out")
    assert_close(torch.cat([x for _, x in parts]), whole_lse, 1e-4, "fp8 hopper chunks lse")


# ---------------------------------------------------------------- pools of a head's rows
# The engine stores fp8 pools of 64-token pages and more as [N, Hkv, PAGE, D] and hands every
# kernel that storage's [N, PAGE, Hkv, D] view (kv_quant.new_kv_pool): the same values at
# other addresses must give the same results, bit for bit.


def _head_major(kv: Fp8Paged) -> Fp8Paged:
    """``kv`` with its K/V pools stored a head's rows of a page together; values unchanged."""
    hm = Fp8Paged.__new__(Fp8Paged)
    hm.__dict__.update(kv.__dict__)
    hm.k, hm.v = head_major_copy(kv.k), head_major_copy(kv.v)
    return hm


# ---------------------------------------------------------------- fp8 pages into 16-bit scratch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_major", [False, True])
def test_dequantize_pages_writes_each_sequences_pages_into_its_scratch_pages(dtype, head_major):
    """Page j of sequence b (its first seq_lens[b] tokens, the last page whole) lands in
    scratch page b * P + j as ``q * scale`` rounded once to the scratch's dtype (the GPU's
    rounding; the interpreter truncates to bf16), from token-row or head-major pools; scratch
    pages past a sequence's last keep what they held."""
    from kernels.kv_dequant import dequantize_pages, scratch_tables

    page, hkv, d = 16, 2, 64
    lens = [int(n) for n in torch.randint(1, 70, (3,))]
    kv = _head_major(Fp8Paged(lens, hkv, d, page)) if head_major else Fp8Paged(lens, hkv, d, page)
    pages = max(-(-n // page) for n in lens) + 1  # one to spare: never written
    out = [torch.full((len(lens) * pages + 2, page, hkv, d), 7.0, dtype=dtype, device=DEVICE)
           for _ in range(2)]  # fmt: skip
    dequantize_pages(kv.k, kv.v, kv.k_scale, kv.v_scale, kv.block_tables, kv.seq_lens, pages,
                     *out)  # fmt: skip
    table = scratch_tables(len(lens), pages, DEVICE)
    assert table.tolist() == [[b * pages + j for j in range(pages)] for b in range(len(lens))]
    for b, n in enumerate(lens):
        for j in range(pages):
            for got, want in zip(out, (kv.kd, kv.vd)):
                dst = got[table[b, j]]
                if j * page < n:
                    src = want[kv.block_tables[b, j].long()].float()
                    if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter truncates
                        gap = (dst.float() - src).abs()  # to bf16: within one step, 2^-7
                        assert (gap <= src.abs() * 2.0**-7).all(), (b, j)
                    else:
                        assert torch.equal(dst, src.to(dtype)), (b, j)
                else:
                    assert (dst == 7.0).all(), (b, j)
    assert (out[0][len(lens) * pages :] == 7.0).all()


# the dequantized-pages tests' shape: 4 query heads over 2 KV heads of 64, 16-token pages
_DQ_HQ, _DQ_HKV, _DQ_D, _DQ_PAGE = 4, 2, 64, 16


def test_prefill_over_dequantized_pages_equals_prefill_over_the_fp8_cache():
    """What ``path="auto"`` does on sm_90 with ``fp8_scratch`` (the Gluon kernel over the
    16-bit copy), with the portable kernel here: the pages into fp32 scratch (exact), the
    scratch's block table, the kernel over it, against the reference on the fp8 cache; NaN
    bytes and scales past each sequence's end ride along into the scratch and stay masked."""
    from kernels.kv_dequant import dequantize_pages, scratch_tables

    qlens = [1, 17, 40]
    kv, bad, pages = _poisoned_batch(qlens, [30, 0, 45])
    scratch = _nan_scratch(len(qlens) * pages)
    dequantize_pages(bad.k, bad.v, bad.k_scale, bad.v_scale, bad.block_tables, bad.seq_lens,
                     pages, *scratch)  # fmt: skip
    q = torch.randn(sum(qlens), _DQ_HQ, _DQ_D, device=DEVICE)
    cu = cu_of(qlens, DEVICE)
    out, lse = prefill_attention(q, *scratch, cu, bad.seq_lens,
                                 scratch_tables(len(qlens), pages, DEVICE), _DQ_D**-0.5,
                                 max_query_len=max(qlens), return_lse=True)  # fmt: skip
    _assert_fp8_reference(q, kv, cu, out, lse, "prefill over the dequantized pages")


def _poisoned_batch(qlens: list[int], ctx: list[int]) -> tuple[Fp8Paged, Fp8Paged, int]:
    """The dequantized-pages tests' fp8 batch (chunks of ``qlens`` after ``ctx`` cached
    tokens; ``_DQ_*``'s shape), its copy poisoned past each end (``_poisoned``), and the
    pages of its longest sequence."""
    kv = Fp8Paged([a + b for a, b in zip(qlens, ctx)], _DQ_HKV, _DQ_D, _DQ_PAGE)
    bad = _poisoned(kv)
    return kv, bad, max(-(-n // _DQ_PAGE) for n in bad.lens)


def _nan_scratch(pages: int) -> list[torch.Tensor]:
    """A float32 scratch K and V of ``pages`` pages, NaN where nothing is written."""
    return [torch.full((pages, _DQ_PAGE, _DQ_HKV, _DQ_D), float("nan"), device=DEVICE)
            for _ in range(2)]  # fmt: skip


def _assert_fp8_reference(q, kv: Fp8Paged, cu, out, lse, what: str) -> None:
    """``out`` and ``lse`` against the float64 reference over ``kv``'s dequantized cache."""
    ref, ref_lse = reference.prefill_attention(q.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                               kv.block_tables, q.shape[2] ** -0.5,
                                               return_lse=True)  # fmt: skip
    assert_close(out, ref, TOL[torch.float32], what)
    assert_close(lse, ref_lse, LSE_TOL[torch.float32], "its lse")


def test_prefill_over_fp8_runs_in_groups_that_fit_the_scratch():
    """A batch whose pages exceed the scratch runs in groups of sequences that fit
    (``kernels.prefill._gluon_over_fp8``): each group dequantized, then its slice of
    ``cu_seqlens_q`` (absolute offsets into q, out and lse) read by the kernel. The Gluon
    kernel's place taken by the portable one over the same arguments; 5 sequences, a scratch
    of 2 sequences' pages: 3 groups, every output row and LSE against the reference."""
    from types import SimpleNamespace

    from kernels.prefill import _gluon_over_fp8

    qlens = [1, 17, 40, 9, 3]
    kv, bad, pages = _poisoned_batch(qlens, [30, 0, 45, 20, 60])
    scratch = _nan_scratch(2 * pages + 1)
    calls = []

    def portable(q, k, v, cu, seq_lens, tables, scale, max_query_len, out, lse, cfg):
        calls.append((int(cu[0]), int(cu[-1]), tables.shape[0]))
        assert k.data_ptr() == scratch[0].data_ptr() and cfg == "cfg"
        _, part = prefill_attention(q, k, v, cu, seq_lens, tables, scale, max_query_len,
                                    out=out, return_lse=True)  # fmt: skip
        lse[calls[-1][0] : calls[-1][1]] = part[calls[-1][0] : calls[-1][1]]

    q = torch.randn(sum(qlens), _DQ_HQ, _DQ_D, device=DEVICE)
    cu = cu_of(qlens, DEVICE)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[0], _DQ_HQ), float("nan"), device=DEVICE)
    _gluon_over_fp8(SimpleNamespace(gluon_prefill=portable), "cfg", q, bad.k, bad.v,
                    bad.k_scale, bad.v_scale, cu, bad.seq_lens, bad.block_tables, _DQ_D**-0.5,
                    max(qlens), out, lse, scratch, pages)  # fmt: skip
    ends = cu.tolist()
    assert calls == [(ends[0], ends[2], 2), (ends[2], ends[4], 2), (ends[4], ends[5], 1)]
    _assert_fp8_reference(q, kv, cu, out, lse, "prefill over the dequantized pages, in groups")


def test_dequantize_pages_checks_its_inputs():
    from kernels.kv_dequant import dequantize_pages

    kv = Fp8Paged([20], 2, 64, 16)
    out = [torch.empty(2, 16, 2, 64, device=DEVICE) for _ in range(2)]
    args = (kv.k, kv.v, kv.k_scale, kv.v_scale, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="out_k must be contiguous"):
        dequantize_pages(*args, 3, *out)  # 3 pages a sequence, 2 in the scratch
    with pytest.raises(ValueError, match="takes an fp8 cache"):
        dequantize_pages(kv.kd.float(), kv.vd.float(), None, None, *args[4:], 2, *out)
    with pytest.raises(ValueError, match="block_tables"):
        dequantize_pages(*args, 5, *[torch.empty(5, 16, 2, 64, device=DEVICE)] * 2)


def test_new_kv_pool_layouts_and_the_rule():
    tm = new_kv_pool(3, 16, 2, 8, FP8_KV_DTYPE, DEVICE)
    hm = new_kv_pool(3, 16, 2, 8, FP8_KV_DTYPE, DEVICE, head_major=True, zeros=True)
    assert tm.shape == hm.shape == (3, 16, 2, 8) and tm.dtype == hm.dtype == FP8_KV_DTYPE
    assert tm.is_contiguous() and not is_head_major(tm)
    assert hm.stride() == (2 * 16 * 8, 8, 16 * 8, 1) and is_head_major(hm)
    assert not hm.float().any(), "zeros=True must zero the pool"
    assert head_major_pages(FP8_KV_DTYPE, 64) and head_major_pages(FP8_KV_DTYPE, 128)
    assert not head_major_pages(FP8_KV_DTYPE, 16) and not head_major_pages(FP8_KV_DTYPE, 32)
    assert not head_major_pages(torch.bfloat16, 128) and not head_major_pages(torch.float16, 64)


HEAD_MAJOR_CASES = [  # (kind, dtype, hq, hkv, d, query lens, cached context, page, options)
    ("decode", torch.float16, 8, 2, 128, [1000, 1, 63], None, 64, {"num_splits": 7}),
    ("decode", torch.bfloat16, 8, 2, 128, [700, 129], None, 128, {}),
    ("decode", torch.float16, 4, 2, 64, [1, 500, 90], None, 64, {"window": 128, "softcap": 5.0}),
    ("decode", torch.float16, 8, 2, 64, [1000, 255, 17], None, 64,
     {"tuning": DecodeTuning(tiles=(128, 4, 3))}),
    ("portable", torch.float16, 4, 2, 64, [40, 3, 17], [100, 0, 64], 64, {}),
    ("hopper", torch.float16, 8, 2, 128, [40, 1, 64], [100, 127, 64], 128,
     {"config": (32, 64, 4, 1, 0)}),
    ("hopper", torch.float16, 4, 2, 64, [50, 1, 20], [70, 31, 200], 64,
     {"config": (32, 32, 4, 1, 2), "softcap": 5.0, "window": 40}),
    ("hopper", torch.float32, 4, 1, 64, [33, 2], [64, 200], 64, {}),
]  # fmt: skip


@pytest.mark.parametrize("kind,dtype,hq,hkv,d,qlens,ctx,page,kw", HEAD_MAJOR_CASES)
def test_head_major_pools_give_the_token_rows_results(kind, dtype, hq, hkv, d, qlens, ctx,
                                                      page, kw):  # fmt: skip
    """Decode (split, windows, soft-caps, 128-token tiles) and prefill (portable, and the
    Hopper path's bulk copies, whose view of the pools changes with the layout: rows of one
    head, NaN in every dead slot) over pools of a head's rows: the results of the same values
    in token rows, bit for bit, and the reference's."""
    lens = qlens if ctx is None else [a + b for a, b in zip(qlens, ctx)]
    kv = Fp8Paged(lens, hkv, d, page)
    ref_kw = {k: v for k, v in kw.items() if k in ("window", "softcap")}
    if kind == "decode":
        q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
        got = [_decode(q, x, d**-0.5, **kw) for x in (kv, _head_major(kv))]
        want = _decode_ref(q, kv, d**-0.5, **ref_kw)
    else:
        starts = [max(0, c - kw["window"] + 1) if "window" in kw else 0 for c in ctx]
        bad = _poisoned(kv, starts) if kind == "hopper" else kv
        q = torch.randn(sum(qlens), hq, d, device=DEVICE).to(dtype)
        cu = cu_of(qlens)
        got = [_prefill(q, x, cu, d**-0.5, path=kind, **kw) for x in (bad, _head_major(bad))]
        want = reference.prefill_attention(q.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                           kv.block_tables, d**-0.5, return_lse=True,
                                           **ref_kw)  # fmt: skip
    (out_tm, lse_tm), (out_hm, lse_hm) = got
    assert torch.equal(out_hm, out_tm), f"{kind} {kw}: output differs between the layouts"
    assert torch.equal(lse_hm, lse_tm), f"{kind} {kw}: LSE differs between the layouts"
    assert_close(out_hm, want[0], TOL[dtype], f"{kind} head-major out {kw}")
    assert_close(lse_hm, want[1], LSE_TOL[dtype], f"{kind} head-major lse {kw}")


@pytest.mark.parametrize("fp8", [True, False])
def test_writes_into_head_major_pools_land_at_the_token_rows_places(fp8):
    """``rope_write_kv`` and the reference's ``write_kv`` into pools of a head's rows: each
    value where the same write into token rows puts it (the pools compared as [N, PAGE, Hkv,
    D]), untouched slots untouched (NaN), scales alike."""
    t, n, bs, hq, hkv, d = 11, 4, 64, 4, 2, 64
    dtype = FP8_KV_DTYPE if fp8 else torch.float16
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE) * 3).to(torch.float16)
    pos = torch.randint(0, 200, (t,), device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEVICE) / d))
    ang = torch.arange(256, device=DEVICE)[:, None] * inv[None]
    cos, sin = ang.cos().half(), ang.sin().half()
    slots = torch.randperm(n * bs, device=DEVICE)[:t]
    slots[3] = -1

    def pools(head_major):
        k, v = (new_kv_pool(n, bs, hkv, d, dtype, DEVICE, head_major) for _ in range(2))
        for x in (k, v):
            x.view(torch.uint8).fill_(0x7F)  # NaN in e4m3 and (twice) in fp16
        scale = torch.full(kv_scale_shape(n, bs, hkv), float("nan"), device=DEVICE)
        return [k, v] + ([scale.to(KV_SCALE_DTYPE), scale.to(KV_SCALE_DTYPE)] if fp8 else [])

    for write in (rope_write_kv, reference.rope_write_kv):
        tm, hm = pools(False), pools(True)
        for p in (tm, hm):
            scales = dict(zip(("k_scale", "v_scale"), p[2:]))
            write(qkv, pos, cos, sin, p[0], p[1], slots, hq, hkv, **scales)
        assert is_head_major(hm[0]) and is_head_major(hm[1])
        for name, a, b in zip(("k", "v", "k_scale", "v_scale"), tm, hm):
            same = torch.equal(_bytes(a.contiguous()), _bytes(b.contiguous()))
            assert same, f"{write.__module__}: {name} differs between the layouts"


def test_head_dim_256_fp8_decode_and_prefill():
    kv = Fp8Paged([40, 300], 1, 256, 16)
    q = torch.randn(2, 2, 256, device=DEVICE, dtype=torch.float16)
    out, _ = _decode(q, kv, 256**-0.5, window=64)
    ref, _ = _decode_ref(q, kv, 256**-0.5, window=64)
    assert_close(out, ref, TOL[torch.float16], "fp8 decode d=256")
    qp = torch.randn(45, 2, 256, device=DEVICE, dtype=torch.float16)
    cu = cu_of([5, 40])
    out, _ = _prefill(qp, kv, cu, 256**-0.5, softcap=10.0)
    ref, _ = reference.prefill_attention(qp.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                         kv.block_tables, 256**-0.5, return_lse=True,
                                         softcap=10.0)  # fmt: skip
    assert_close(out, ref, TOL[torch.float16], "fp8 prefill d=256")


def test_small_values_keep_their_precision_in_fp16():
    """V whose values are ~1e-4 (scales ~7e-7): p * v_scale alone would be an fp16 subnormal
    (below 6.1e-5); the kernels' power-of-two shift (V_SCALE_SHIFT) keeps fp16's tolerance,
    for bf16 queries too (decode's f16 dots)."""
    kv = Fp8Paged([600, 5], 2, 64, 16, spread=0.0, gain=1e-4)
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(2, 4, 64, device=DEVICE).to(dtype)
        out, _ = _decode(q, kv, 0.125)
        ref, _ = _decode_ref(q, kv, 0.125)
        assert_close(out, ref, TOL[dtype], f"fp8 decode, small V, {dtype}")
    cu = cu_of([20, 5])
    qp = torch.randn(25, 4, 64, device=DEVICE, dtype=torch.float16)
    out, _ = _prefill(qp, kv, cu, 0.125)
    ref, _ = reference.prefill_attention(qp.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                         kv.block_tables, 0.125, return_lse=True)  # fmt: skip
    assert_close(out, ref, TOL[torch.float16], "fp8 prefill, small V")


@pytest.mark.parametrize("gain", [1e5, 1e-6])
def test_fp8_bf16_queries_outside_f16s_range(gain):
    """bf16 queries up to ~4e5 (past f16's 65,504) or ~4e-6 (f16 subnormals, 11 bits lost),
    with the softmax scale divided by the same factor so the scores are ordinary: decode's and
    prefill's f16 dots take q times a power of two (``common.f16_queries``) and keep bf16's
    tolerance."""
    kv = Fp8Paged([300, 1, 77], 2, 64, 16)
    q = (torch.randn(3, 4, 64, device=DEVICE) * gain).to(torch.bfloat16)
    qp = (torch.randn(50, 4, 64, device=DEVICE) * gain).to(torch.bfloat16)
    cu = cu_of([40, 1, 9])  # chunks at the end of each sequence
    scale = 0.125 / gain
    for kw in ({}, {"window": 200, "softcap": 4.0}):
        out, lse = _decode(q, kv, scale, **kw)
        ref, ref_lse = _decode_ref(q, kv, scale, **kw)
        assert_close(out, ref, TOL[torch.bfloat16], f"fp8 decode, queries x {gain} {kw}")
        assert_close(lse, ref_lse, LSE_TOL[torch.bfloat16], f"fp8 decode lse x {gain} {kw}")
        out, lse = _prefill(qp, kv, cu, scale, **kw)
        ref, ref_lse = reference.prefill_attention(qp.double(), kv.kd, kv.vd, cu, kv.seq_lens,
                                                   kv.block_tables, scale, return_lse=True,
                                                   **kw)  # fmt: skip
        assert_close(out, ref, TOL[torch.bfloat16], f"fp8 prefill, queries x {gain} {kw}")
        assert_close(lse, ref_lse, LSE_TOL[torch.bfloat16], f"fp8 prefill lse x {gain} {kw}")


def test_reference_attention_reads_fp8_as_its_dequantized_cache():
    """The torch backend's path: the reference given fp8 pools and scales computes what it
    computes on the dequantized pools (float64 queries: float64 dequantization)."""
    kv = Fp8Paged([1, 40, 77], 2, 32, 16)
    q = torch.randn(3, 4, 32, device=DEVICE, dtype=torch.float64)
    got = reference.decode_attention(q, kv.k, kv.v, kv.seq_lens, kv.block_tables, 0.2,
                                     return_lse=True, window=30, **kv.scales)  # fmt: skip
    want = reference.decode_attention(q, kv.kd, kv.vd, kv.seq_lens, kv.block_tables, 0.2,
                                      return_lse=True, window=30)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    q32 = q.float()
    out = reference.prefill_attention(q32, kv.k, kv.v, cu_of([1, 1, 1]), kv.seq_lens,
                                      kv.block_tables, 0.2, window=30, **kv.scales)  # fmt: skip
    assert_close(out, want[0], 1e-5, "reference fp8 through SDPA (float32)")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"k_scale": None}, "needs k_scale and v_scale"),
        ({"v_scale": "float32"}, r"v_scale must be a contiguous torch.bfloat16"),
        ({"k_scale": "transposed"}, r"k_scale must be a contiguous"),
        ({"k_cache": "fp16"}, "are for fp8 caches"),
    ],
)
def test_fp8_inputs_are_checked(change, message):
    kv = Fp8Paged([20], 2, 32, 16)
    args = {"k_cache": kv.k, "v_cache": kv.v, **kv.scales}
    for name, how in change.items():
        if how is None:
            args[name] = None
        elif how == "float32":
            args[name] = args[name].float()
        elif how == "transposed":
            args[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)
        else:
            args["k_cache"], args["v_cache"] = kv.k.half(), kv.v.half()
    q = torch.randn(1, 4, 32, device=DEVICE, dtype=torch.float16)
    with pytest.raises(ValueError, match=message):
        decode_attention(q, seq_lens=kv.seq_lens, block_tables=kv.block_tables, scale=0.2,
                         **args)  # fmt: skip
    with pytest.raises(ValueError, match=message):
        prefill_attention(q, cu_seqlens_q=cu_of([1]), seq_lens=kv.seq_lens,
                          block_tables=kv.block_tables, scale=0.2, **args)  # fmt: skip


def test_fp8_decode_plan_takes_the_fp8_tiles():
    """Over an fp8 cache read with f16 dots the split plan takes ``DecodeTuning.fp8_tiles`` at
    every split length, and with none bf16's (the same tiles
    and splits); head dims over 128 keep their wide tiles; a 16-bit cache never takes them."""
    from kernels.decode import DecodeTuning, plan_splits

    fp8_tiles = DecodeTuning().fp8_tiles
    same = DecodeTuning(fp8_tiles=None)
    for batch, ctx in ((1, 4096), (1, 131072), (8, 16384)):
        assert plan_splits(batch, 8, 128, 1, ctx, 132, fp8=True).tiles == fp8_tiles
        assert plan_splits(batch, 8, 128, 2, ctx, 132).tiles != fp8_tiles
        assert plan_splits(batch, 8, 128, 1, ctx, 132, same, fp8=True) == plan_splits(
            batch, 8, 128, 2, ctx, 132
        )
    tuned = DecodeTuning(fp8_tiles=(64, 8, 5))
    assert plan_splits(1, 8, 128, 1, 4096, 132, tuned, fp8=True).tiles == (64, 8, 5)
    assert plan_splits(1, 8, 256, 1, 4096, 132, tuned, fp8=True).tiles == tuned.wide_tiles
    with pytest.raises(ValueError, match="fp8_tiles"):
        DecodeTuning(fp8_tiles=(100, 4, 3))
