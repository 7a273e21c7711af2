"""Rotary position embedding of a step's queries and keys, fused with the KV store (Triton).

One program per token reads its row of the fused QKV projection, rotates the query and key heads
by the token's position (``x * cos + rotate_half(x) * sin``, the two halves of the rotated dims
turning together), writes the rotated queries out, and stores the rotated keys and the values
in the paged cache at the token's slot (-1: a CUDA-graph padding token, not stored).

Two options of the newer architectures ride along in the same pass, as the program already
holds each of its token's heads: per-head RMSNorm of q and k over the head dim before the
rotation (Qwen3, Gemma 3: ``q_norm``/``k_norm``, Gemma's ``(1 + w)`` form with
``norm_unit_offset``), and partial rotary (Phi: tables ``[P, R/2]`` with ``R < D`` rotate only
the first ``R`` dims, the rest pass through). Each dim is loaded with the one it turns with, so
any head dim works (64, 80, 96, 128, 256); its cos/sin pair is loaded per dim, the sin negated
for the first half, so one product-and-sum form covers both halves.

Products and sums are rounded to the activations' dtype where torch's elementwise version
rounds, so without head norms the result equals ``kernels.reference.rope_write_kv`` bit for
bit: Triton turns the rounded float32 products into native bf16/fp16 multiplies, and with FP
fusion on (its default) would merge a multiply and the following add into one FMA, which skips
a rounding; the kernel is compiled without. The head norms round as ``reference.rms_norm``
does; only the order of their float32 sum of squares differs from torch (an ulp of the normed
value at most, which the rotation carries along).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import check_kv_pages, pdl_enter, pdl_kwargs, pdl_trigger


@triton.jit
def _heads(
    Row,  # this token's first element of the heads (a Q or K section of the QKV row)
    W,  # [D], the heads' RMSNorm weight (HAS_NORM)
    offs_h,  # [BH] head index
    offs_d,  # [BD] dim index within a head
    mask,  # [BH, BD]
    partner,  # [BD] the dim that rotates with each one (itself past the rotated dims)
    rotated,  # [BD] bool, the dim is among the first R
    c,  # [1, BD] float32 cos of each dim's pair (1 past R)
    s,  # [1, BD] float32 sin, negated for the first half (0 past R)
    eps,
    D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    DT: tl.constexpr,
):
    """A token's heads ``[BH, BD]``, RMS-normalised over ``D`` (HAS_NORM), then rotated:
    ``x * c + partner(x) * s`` on the first R dims, each product and the sum rounded to DT."""
    pmask = mask & rotated[None, :]
    x = tl.load(Row + offs_h[:, None] * D + offs_d[None, :], mask=mask, other=0.0)
    xp = tl.load(Row + offs_h[:, None] * D + partner[None, :], mask=pmask, other=0.0)
    x, xp = x.to(tl.float32), xp.to(tl.float32)
    if HAS_NORM:
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]  # [BH, 1]
        w = tl.load(W + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(W + partner, mask=rotated, other=0.0).to(tl.float32)[None, :]
        if UNIT_OFFSET:  # Gemma: ((1 + w) * x_f32).to(DT)
            x = ((x * inv) * (1.0 + w)).to(DT).to(tl.float32)
            xp = ((xp * inv) * (1.0 + wp)).to(DT).to(tl.float32)
        else:  # Llama / Qwen3: w * x_f32.to(DT), rounded to DT
            x = (w * (x * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
            xp = (wp * (xp * inv).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    a = (x * c).to(DT).to(tl.float32)
    b = (xp * s).to(DT).to(tl.float32)
    return tl.where(rotated[None, :], (a + b).to(DT), x.to(DT))


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
    Slots,  # [T] int64
    stride_t,
    stride_qt,
    stride_qh,
    stride_cos,
    stride_cb,
    stride_cs,
    stride_ch,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,  # R / 2, R <= D the rotated dims
    PAGE: tl.constexpr,
    HAS_QNORM: tl.constexpr,
    HAS_KNORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    CHAIN: tl.constexpr,
):
    pdl_enter(CHAIN, PDL)  # PDL: the attention kernel after this one may start; it waits
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    # dim d < R/2 turns with d + R/2 (x1 * c - x2 * s), d in [R/2, R) with d - R/2
    # (x2 * c + x1 * s); dims from R on pass through
    offs_d = tl.arange(0, BLOCK_D)
    first = offs_d < HALF
    rotated = offs_d < 2 * HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    pair = tl.where(first, offs_d, offs_d - HALF)
    c = tl.load(Cos + pos * stride_cos + pair, mask=rotated, other=1.0).to(tl.float32)
    s = tl.load(Sin + pos * stride_cos + pair, mask=rotated, other=0.0).to(tl.float32)
    c, s = c[None, :], tl.where(first, -s, s)[None, :]
    row = QKV + t * stride_t

    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h[:, None] < HQ) & (offs_d[None, :] < D)  # [BHQ, BD]
    q = _heads(row, QNorm, offs_h, offs_d, mask, partner, rotated, c, s, eps,
               D, HAS_QNORM, UNIT_OFFSET, QOut.dtype.element_ty)  # fmt: skip
    dst = QOut + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(dst, q, mask=mask)

    slot = tl.load(Slots + t)
    if slot >= 0:
        offs_g = tl.arange(0, BLOCK_HKV)
        kv_mask = (offs_g[:, None] < HKV) & (offs_d[None, :] < D)  # [BHKV, BD]
        k = _heads(row + HQ * D, KNorm, offs_g, offs_d, kv_mask, partner, rotated, c, s, eps,
                   D, HAS_KNORM, UNIT_OFFSET, QOut.dtype.element_ty)  # fmt: skip
        v_src = row + (HQ + HKV) * D + offs_g[:, None] * D + offs_d[None, :]
        v = tl.load(v_src, mask=kv_mask, other=0.0)
        page_off = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        c_off = page_off + offs_g[:, None] * stride_ch + offs_d[None, :]
        tl.store(KCache + c_off, k.to(KCache.dtype.element_ty), mask=kv_mask)
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
    chain: bool = True,
) -> torch.Tensor:  # [T, Hq, D]
    """``kernels.reference.rope_write_kv`` in one kernel (see the module doc); ``chain``: join
    the decode layer's PDL chain where the device supports it (``kernels.common.pdl_chain``)."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(num_heads + 2 * num_kv_heads) * d}] with "
                         f"contiguous rows; got {tuple(qkv.shape)}")  # fmt: skip
    check_kv_pages(k_cache, v_cache, num_kv_heads, d)
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
    _rope_write_kv_kernel[(t,)](
        qkv, positions, cos, sin, qkv if q_norm is None else q_norm,
        qkv if k_norm is None else k_norm, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), norm_eps,
        HQ=num_heads, HKV=num_kv_heads, D=d, HALF=half, PAGE=page,
        HAS_QNORM=q_norm is not None, HAS_KNORM=k_norm is not None,
        UNIT_OFFSET=norm_unit_offset,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(d),
        PDL=pdl_trigger(qkv.device), **pdl_kwargs(qkv.device, chain),
        num_warps=4 if num_heads * d >= 2048 else 2,
        enable_fp_fusion=False,  # a fused multiply-add would skip a rounding torch does
    )  # fmt: skip
    return q


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
