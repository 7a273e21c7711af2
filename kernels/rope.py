"""Rotary position embedding of a step's queries and keys, fused with the KV store (Triton).

One program per token reads its row of the fused QKV projection, rotates the query and key heads
by the token's position (``x * cos + rotate_half(x) * sin``, the two halves of the head dim
rotating together), writes the rotated queries out, and stores the rotated keys and the values
in the paged cache at the token's slot (-1: a CUDA-graph padding token, not stored). Products
and sums are rounded to the activations' dtype where torch's elementwise version rounds, so the
result equals ``kernels.reference.rope_write_kv``: Triton turns the rounded float32 products
into native bf16/fp16 multiplies, and with FP fusion on (its default) would merge a multiply
and the following add into one FMA, which skips a rounding; the kernel is compiled without.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import check_kv_pages, pdl_enter, pdl_kwargs, pdl_trigger


@triton.jit
def _rotate(x1, x2, c, s, DT: tl.constexpr):
    """(x1 * c - x2 * s, x2 * c + x1 * s), each product and sum rounded to DT."""
    a = (x1 * c).to(DT).to(tl.float32)
    b = (x2 * s).to(DT).to(tl.float32)
    e = (x2 * c).to(DT).to(tl.float32)
    f = (x1 * s).to(DT).to(tl.float32)
    return (a - b).to(DT), (e + f).to(DT)


@triton.jit
def _rope_write_kv_kernel(
    QKV,  # [T, (Hq + 2 Hkv) * D]
    Pos,  # [T] int64
    Cos,  # [P, D/2]
    Sin,  # [P, D/2]
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
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,  # D / 2
    PAGE: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
    CHAIN: tl.constexpr,
):
    pdl_enter(CHAIN, PDL)  # PDL: the attention kernel after this one may start; it waits
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Pos + t)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    c = tl.load(Cos + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(Sin + pos * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    row = QKV + t * stride_t

    offs_h = tl.arange(0, BLOCK_HQ)
    mask = (offs_h[:, None] < HQ) & d_mask[None, :]  # [BHQ, BHALF]
    src = row + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c, s, QOut.dtype.element_ty)
    dst = QOut + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    tl.store(dst, o1, mask=mask)
    tl.store(dst + HALF, o2, mask=mask)

    slot = tl.load(Slots + t)
    if slot >= 0:
        offs_g = tl.arange(0, BLOCK_HKV)
        kv_mask = (offs_g[:, None] < HKV) & d_mask[None, :]  # [BHKV, BHALF]
        k_src = row + HQ * 2 * HALF + offs_g[:, None] * (2 * HALF) + offs_d[None, :]
        v_src = k_src + HKV * 2 * HALF
        k1 = tl.load(k_src, mask=kv_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_src + HALF, mask=kv_mask, other=0.0).to(tl.float32)
        v1 = tl.load(v_src, mask=kv_mask, other=0.0)
        v2 = tl.load(v_src + HALF, mask=kv_mask, other=0.0)
        k1, k2 = _rotate(k1, k2, c, s, QOut.dtype.element_ty)
        page_off = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        c_off = page_off + offs_g[:, None] * stride_ch + offs_d[None, :]
        tl.store(KCache + c_off, k1.to(KCache.dtype.element_ty), mask=kv_mask)
        tl.store(KCache + c_off + HALF, k2.to(KCache.dtype.element_ty), mask=kv_mask)
        tl.store(VCache + c_off, v1.to(VCache.dtype.element_ty), mask=kv_mask)
        tl.store(VCache + c_off + HALF, v2.to(VCache.dtype.element_ty), mask=kv_mask)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [P, D/2]
    sin: torch.Tensor,  # [P, D/2]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 marks a padding token that is not stored
    num_heads: int,
    num_kv_heads: int,
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
    if d % 2 or cos.shape[1:] != (d // 2,) or sin.shape != cos.shape or cos.stride(1) != 1:
        raise ValueError(f"cos and sin must be [P, {d // 2}]; got {tuple(cos.shape)}")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"positions and slot_mapping must be [{t}]")
    page = k_cache.shape[1]
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    _rope_write_kv_kernel[(t,)](
        qkv, positions, cos, sin, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HQ=num_heads, HKV=num_kv_heads, HALF=d // 2, PAGE=page,
        BLOCK_HQ=triton.next_power_of_2(num_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
        PDL=pdl_trigger(qkv.device), **pdl_kwargs(qkv.device, chain),
        num_warps=4 if num_heads * d >= 2048 else 2,
        enable_fp_fusion=False,  # a fused multiply-add would skip a rounding torch does
    )  # fmt: skip
    return q
