"""Rotary position embedding of a step's queries and keys, fused with the KV store (Triton).

Each program takes a group of one token's heads from its row of the fused QKV projection: query
heads it rotates by the token's position (``x * cos + rotate_half(x) * sin``, the two halves of
the rotated dims turning together) and writes out; KV heads it rotates (the keys) and stores
with the values in the paged cache at the token's slot (-1: a CUDA-graph padding token, not
stored). A decode step takes one head a program, so that its few tokens' heads spread over
the SMs; larger steps take all a token's query heads in one program and its KV heads in
another (``rope_heads_per_program``).

Two options of the newer architectures ride along in the same pass, as the program already
holds each of its heads: per-head RMSNorm of q and k over the head dim before the
rotation (Qwen3, Gemma 3: ``q_norm``/``k_norm``, Gemma's ``(1 + w)`` form with
``norm_unit_offset``), and partial rotary (Phi: tables ``[P, R/2]`` with ``R < D`` rotate only
the first ``R`` dims, the rest pass through). A head is held as its two rotating halves (and
the dims past ``R``), each padded to a power of two, so any head dim works (64, 80, 96, 128,
256); the full-rotary, norm-free path is the kernel as it was before these options.

Products and sums are rounded to the activations' dtype where torch's elementwise version
rounds, so without head norms the result equals ``kernels.reference.rope_write_kv`` bit for
bit: Triton turns the rounded float32 products into native bf16/fp16 multiplies, and with FP
fusion on (its default) would merge a multiply and the following add into one FMA, which skips
a rounding; the kernel is compiled without. The head norms round as ``reference.rms_norm``
does; only the order of their float32 sum of squares differs from torch (an ulp of the normed
value at most, which the rotation carries along).

An fp8 cache (``k_scale``/``v_scale`` given; ``kernels.kv_quant``) gets each key and value head
quantized in the same pass, from the rounded values the reference stores: the head's amax,
its scale (``amax / 448`` rounded to bf16, stored at the token's slot of the scale pool) and
``x / scale`` rounded to e4m3, all as ``kv_quant.quantize_fp8`` computes them (correctly
rounded divisions, round to nearest even), so the fp8 bytes and scales equal the reference's.
The rounding to e4m3 is done in float32 arithmetic (``_e4m3``) and the exact result converted:
Triton's interpreter converts float32 to float8e4nv wrongly (it drops the carry into the
exponent: 127.9 -> 64, not 128; Triton 3.9), and the GPU's conversion of an exact value is
the same either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import check_kv_pages, pdl_enter, pdl_kwargs, pdl_trigger
from kernels.kv_quant import FP8_AMAX_FLOOR, FP8_MAX, KV_SCALE_DTYPE, check_kv_scales

assert KV_SCALE_DTYPE == torch.bfloat16, "_fp8_scale rounds the scales to bf16"
# the format's constants as the kernel sees them (a jit function reads constexpr globals only)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
# Programs of one head each up to this many heads in a step (``rope_heads_per_program``). H200,
# bf16, graph replay, µs, one head a program / a token's query heads in one and KV heads in
# another (docs/benchmarks/rope_split_bench.py): Gemma 3 (16/8 of 256, q/k norms) at 1, 4, 32
# tokens 2.31 / 2.66, 2.38 / 2.64, 2.61 / 2.81; Llama 3 (32/8 of 128) 1.93 / 1.99, 2.00 /
# 2.02, 2.60 / 2.12; at 256 tokens 8.7-13.7 / 3.3-5.0.
_SPLIT_HEADS_MAX = 512


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """(x1 * c - x2 * s, x2 * c + x1 * s), each product and sum rounded to DT."""
    a = (x1 * c).to(DT).to(tl.float32)
    b = (x2 * s).to(DT).to(tl.float32)
    e = (x2 * c).to(DT).to(tl.float32)
    f = (x1 * s).to(DT).to(tl.float32)
    return (a - b).to(DT), (e + f).to(DT)


@triton.jit
def _e4m3(x, scale):
    """``x / scale`` clamped to +-448 and rounded to the nearest e4m3 value (ties to even), as
    float32: ``(a + c) - c`` rounds ``a`` to a multiple of ``ulp(c)``, and ``c = 2^(e + 20)``
    makes that e4m3's step in ``a``'s binade ``[2^e, 2^(e+1))``, ``2^(e-3)`` (``2^-9`` below
    2^-6, e4m3's subnormals); a carry into the next binade comes out right. The sign is
    copied bitwise, so -0 stays -0 as in torch."""
    y = tl.math.div_rn(x, scale)
    a = tl.minimum(tl.abs(y), _FP8_MAX)
    e = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 127 - 6)  # biased exponent
    c = ((e + 20) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    # the sign bit copied bitwise: Triton's -r is 0 - r, +0 for r = 0 (the H100 stored +0 for
    # a value torch rounds to -0)
    sign = y.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_scale(amax):
    """A head's scale from its amax (float32 [BH]): ``max(amax, floor) / 448`` rounded to
    bf16 (``KV_SCALE_DTYPE``), to nearest even on the float32 bits (the interpreter's
    ``.to(tl.bfloat16)`` truncates; Triton 3.9); returned in float32 [BH], exactly the value
    that is stored. Positive and finite: no sign or NaN to mind."""
    s = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _FP8_MAX)
    bits = s.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # keep the top 16 bits, rounded
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _normed(x, inv, W, offs, mask, UNIT_OFFSET: tl.constexpr, DT: tl.constexpr):
    """``x * inv`` scaled by the weights ``W[offs]`` as ``reference.rms_norm`` rounds: Gemma's
    ``((1 + w) * x_f32).to(DT)``, else ``w * x_f32.to(DT)`` rounded to DT; float32 out."""
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:
        return ((x * inv) * (1.0 + w)).to(DT).to(tl.float32)
    return (w * (x * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _rope_heads(
    Src,  # this token's first element of the heads (a Q or K section of its QKV row)
    Dst,  # where the first head goes (a row of QOut, a slot of KCache)
    stride_dh,  # Dst's head stride
    W,  # [D], the heads' RMSNorm weight (HAS_NORM)
    n_heads,
    c,  # [1, BHALF] float32
    s,  # [1, BHALF] float32
    eps,
    D: tl.constexpr,
    HALF: tl.constexpr,  # R / 2
    HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    DT: tl.constexpr,  # the activations' dtype, where torch rounds
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # 0: every dim rotates
    Scale=None,  # QUANT: where the first head's scale goes (the token's slot, scale pool)
    stride_sh=0,  # QUANT: the scale pool's head stride
    QUANT: tl.constexpr = False,  # Dst is fp8: quantize each head (``_e4m3``)
):
    """A token's heads: RMS-normalised over their ``D`` dims (HAS_NORM), the first ``R``
    rotated, the rest passed through, stored at ``Dst`` (QUANT: quantized per head, with its
    scale stored at ``Scale``)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_HALF)
    m_r = (offs_h[:, None] < n_heads) & (offs_r[None, :] < HALF)  # [BH, BHALF]
    src = Src + offs_h[:, None] * D
    dst = Dst + offs_h[:, None] * stride_dh
    x1 = tl.load(src + offs_r[None, :], mask=m_r, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs_r[None, :], mask=m_r, other=0.0).to(tl.float32)
    if BLOCK_PASS > 0:  # partial rotary: dims R..D
        offs_p = tl.arange(0, BLOCK_PASS)
        m_p = (offs_h[:, None] < n_heads) & (offs_p[None, :] < D - 2 * HALF)  # [BH, BPASS]
        xp = tl.load(src + 2 * HALF + offs_p[None, :], mask=m_p, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)  # [BH]
        if BLOCK_PASS > 0:
            ss += tl.sum(xp * xp, axis=1)
        inv = tl.math.rsqrt(ss / D + eps)[:, None]  # [BH, 1]
        x1 = _normed(x1, inv, W, offs_r, offs_r < HALF, UNIT_OFFSET, DT)
        x2 = _normed(x2, inv, W + HALF, offs_r, offs_r < HALF, UNIT_OFFSET, DT)
        if BLOCK_PASS > 0:
            xp = _normed(xp, inv, W + 2 * HALF, offs_p, offs_p < D - 2 * HALF, UNIT_OFFSET, DT)
    o1, o2 = _rotate(x1, x2, c, s, DT)
    if QUANT:  # the rounded head, as the reference quantizes it
        o1, o2 = o1.to(tl.float32), o2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(o1), 1), tl.max(tl.abs(o2), 1))  # [BH]
        if BLOCK_PASS > 0:
            amax = tl.maximum(amax, tl.max(tl.abs(xp), 1))
        sc = _fp8_scale(amax)  # [BH]
        tl.store(Scale + offs_h * stride_sh, sc.to(Scale.dtype.element_ty), mask=offs_h < n_heads)
        o1, o2 = _e4m3(o1, sc[:, None]), _e4m3(o2, sc[:, None])
        if BLOCK_PASS > 0:
            xp = _e4m3(xp, sc[:, None])
    tl.store(dst + offs_r[None, :], o1.to(Dst.dtype.element_ty), mask=m_r)
    tl.store(dst + HALF + offs_r[None, :], o2.to(Dst.dtype.element_ty), mask=m_r)
    if BLOCK_PASS > 0:
        tl.store(dst + 2 * HALF + offs_p[None, :], xp.to(Dst.dtype.element_ty), mask=m_p)


@triton.jit
def _rope_write_kv_kernel(
    QKV,  # [T, (Hq + 2 Hkv) * D]
    Pos,  # [T] int64
    Cos,  # [P, R/2]
    Sin,  # [P, R/2]
    QNorm,  # [D] (HAS_QNORM)
    KNorm,  # [D] (HAS_KNORM)
    QOut,  # [T, Hq, D]
    KCache,  # [N, BS, Hkv, D]
    VCache,  # [N, BS, Hkv, D]
    KScale,  # [N, Hkv, BS] (QUANT)
    VScale,  # [N, Hkv, BS] (QUANT)
    Slots,  # [T] int64
    stride_t,
    stride_qt,
    stride_qh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,  # QUANT: the scale pools' block stride (head stride PAGE, token stride 1)
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # R / 2, R <= D the rotated dims
    PAGE: tl.constexpr,
    HAS_QNORM: tl.constexpr,
    HAS_KNORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    QUANT: tl.constexpr,  # an fp8 cache: quantize K and V per head, store their scales
    QH: tl.constexpr,  # query heads a program (a power of two); QH >= HQ: all in one
    KH: tl.constexpr,  # KV heads a program (a power of two); KH >= HKV: all in one
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # 0 unless R < D
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    CHAIN: tl.constexpr,
):
    """Program (t, j): token t's query heads [j QH, (j + 1) QH) for j < cdiv(HQ, QH), else its
    KV heads [i KH, (i + 1) KH), i = j - cdiv(HQ, QH)."""
    # PDL: the attention kernel after this one may start now, before this one's wait in the
    # chain below (its L2 prefetch reads only earlier rows, kernels.decode); it waits for this one
    pdl_enter(False, TRIGGER=CHAIN or PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    # Before the wait (chained: launched early, while the QKV GEMV runs) only the step's
    # inputs, there before the step's first kernel: the token's position, its slot and its
    # rows of the tables, so that after the wait one round trip to L2 (the QKV row) is left
    # where the position's, then the tables', came first.
    pos = tl.load(Pos + t)
    slot = tl.load(Slots + t)
    offs_r = tl.arange(0, BLOCK_HALF)
    r_mask = offs_r < HALF
    c = tl.load(Cos + pos * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + pos * stride_cos + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    if CHAIN:
        tl.extra.cuda.gdc_wait()
    row = QKV + t * stride_t
    DT = QOut.dtype.element_ty
    Q_PROGRAMS: tl.constexpr = (HQ + QH - 1) // QH
    if j < Q_PROGRAMS:
        h0 = j * QH
        _rope_heads(row + h0 * D, QOut + t * stride_qt + h0 * stride_qh, stride_qh, QNorm,
                    tl.minimum(HQ - h0, QH), c, s, eps, D, HALF, HAS_QNORM, UNIT_OFFSET, DT, QH,
                    BLOCK_HALF, BLOCK_PASS)  # fmt: skip
    else:
        if slot >= 0:
            g0 = (j - Q_PROGRAMS) * KH
            n_kv = tl.minimum(HKV - g0, KH)
            # V is loaded before the K stores, which it would otherwise wait for (they may alias):
            # H100, bf16, 32/8 heads of 128, one token, in a CUDA graph: 1.98 us after, 1.80
            # before (the kernel before these options: 1.79); 16/8 of 256: 2.26 (2.24)
            offs_g = tl.arange(0, KH)
            offs_d = tl.arange(0, BLOCK_D)
            kv_mask = (offs_g[:, None] < n_kv) & (offs_d[None, :] < D)  # [KH, BD]
            v = tl.load(row + (HQ + HKV + g0) * D + offs_g[:, None] * D + offs_d[None, :],
                        mask=kv_mask, other=0.0)  # fmt: skip
            page_off = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + g0 * stride_ch
            if QUANT:
                s_off = (slot // PAGE) * stride_sb + slot % PAGE + g0 * PAGE  # head g0's scale
                _rope_heads(row + (HQ + g0) * D, KCache + page_off, stride_ch, KNorm, n_kv, c, s,
                            eps, D, HALF, HAS_KNORM, UNIT_OFFSET, DT, KH, BLOCK_HALF, BLOCK_PASS,
                            KScale + s_off, PAGE, QUANT=True)  # fmt: skip
                v = v.to(tl.float32)
                vs = _fp8_scale(tl.max(tl.abs(v), 1))  # [KH]
                tl.store(VScale + s_off + offs_g * PAGE, vs.to(VScale.dtype.element_ty),
                         mask=offs_g < n_kv)  # fmt: skip
                v = _e4m3(v, vs[:, None])
            else:  # the statements (and so the compiled code) of the kernel before fp8
                _rope_heads(row + (HQ + g0) * D, KCache + page_off, stride_ch, KNorm, n_kv, c, s,
                            eps, D, HALF, HAS_KNORM, UNIT_OFFSET, DT, KH, BLOCK_HALF,
                            BLOCK_PASS)  # fmt: skip
            c_off = page_off + offs_g[:, None] * stride_ch + offs_d[None, :]
            tl.store(VCache + c_off, v.to(VCache.dtype.element_ty), mask=kv_mask)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, R/2], R <= D the rotated dims
    sin: torch.Tensor,  # [P, R/2]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 marks a padding token that is not stored
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,  # [D]: RMSNorm each query head first (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None,  # [D]: the same for each key head
    norm_eps: float = 1e-6,
    norm_unit_offset: bool = False,  # the q/k norms are Gemma's ``(1 + w)`` norms
    *,
    k_scale: torch.Tensor | None = None,  # [N, Hkv, BS]: an fp8 cache's scale pools
    v_scale: torch.Tensor | None = None,
    chain: bool = True,
    heads_per_program: tuple[int, int] | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """``kernels.reference.rope_write_kv`` in one kernel (see the module doc); ``chain``: join
    the decode layer's PDL chain where the device supports it (``kernels.common.pdl_chain``).
    An fp8 cache (``float8_e4m3fn`` pools) needs its scale pools ``k_scale``/``v_scale``.
    ``heads_per_program``: (query, KV) heads a program, powers of two (default
    ``rope_heads_per_program``)."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * d}] with "
                         f"contiguous rows; got {tuple(qkv.shape)}")  # fmt: skip
    check_kv_pages(k_cache, v_cache, num_kv_heads, d)
    quant = check_kv_scales(k_cache, k_scale, v_scale)
    half = cos.shape[1] if cos.dim() == 2 else 0
    if not 0 < half <= d // 2 or sin.shape != cos.shape or cos.stride(1) != 1:
        raise ValueError(f"cos and sin must be [P, R/2] with R <= {d}; got {tuple(cos.shape)}")
    if sin.stride() != cos.stride():
        raise ValueError("cos and sin must have the same strides")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        _check_norm(name, w, d, qkv.dtype, norm_unit_offset)
    page = k_cache.shape[1]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    qh, kh = heads_per_program or rope_heads_per_program(t, num_heads, num_kv_heads)
    if qh & (qh - 1) or kh & (kh - 1) or qh < 1 or kh < 1:
        raise ValueError(f"heads_per_program must be two powers of two; got {(qh, kh)}")
    qh = min(qh, triton.next_power_of_2(num_heads))
    kh = min(kh, triton.next_power_of_2(num_kv_heads))
    grid = (t, triton.cdiv(num_heads, qh) + triton.cdiv(num_kv_heads, kh))
    work = max(min(qh, num_heads), min(kh, num_kv_heads)) * d  # a program's elements of a tensor
    _rope_write_kv_kernel[grid](
        qkv, positions, cos, sin, qkv if q_norm is None else q_norm,
        qkv if k_norm is None else k_norm, q, k_cache, v_cache,
        k_scale if quant else k_cache, v_scale if quant else v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if quant else 0, norm_eps,
        HQ=num_heads, HKV=num_kv_heads, D=d, HALF=half, PAGE=page,
        HAS_QNORM=q_norm is not None, HAS_KNORM=k_norm is not None,
        UNIT_OFFSET=norm_unit_offset, QUANT=quant, QH=qh, KH=kh,
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(d - 2 * half) if 2 * half < d else 0,
        BLOCK_D=triton.next_power_of_2(d),
        PDL=pdl_trigger(qkv.device), **pdl_kwargs(qkv.device, chain),
        num_warps=4 if work >= 2048 else 2 if work >= 256 else 1,
        enable_fp_fusion=False,  # a fused multiply-add would skip a rounding torch does
    )  # fmt: skip
    return q


def rope_heads_per_program(t: int, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """(query heads, KV heads) a program of ``t`` tokens: one head each while the step is small
    (a decode step at a small batch: one program per token would run every head's norm,
    rotation and stores in one SM), else all of a token's query heads in one program and all
    its KV heads in another."""
    if t * (num_heads + num_kv_heads) <= _SPLIT_HEADS_MAX:
        return 1, 1
    return triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)


def _check_norm(
    name: str, w: torch.Tensor | None, d: int, dtype: torch.dtype, unit_offset: bool
) -> None:
    """A head norm's weight is ``[D]``, contiguous; in the activations' dtype unless it is
    Gemma's (torch's ``w * x`` would promote the queries to the weight's dtype)."""
    if w is None:
        return
    if w.shape != (d,) or w.stride(0) != 1:
        raise ValueError(f"{name} must be a contiguous [{d}]; got {tuple(w.shape)}")
    if not unit_offset and w.dtype != dtype:
        raise ValueError(f"{name} is {w.dtype}, the activations {dtype}: they must match")
