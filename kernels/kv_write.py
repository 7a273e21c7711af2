"""Store this step's K and V into the paged cache (Triton).

Token ``t`` with slot ``s = slot_mapping[t] >= 0`` goes to ``cache[s // BS, s % BS]``; a slot of
-1 marks a padding token (a CUDA-graph batch filler) that is not stored. One program per token
copies its ``Hkv x D`` K and V rows, casting to the cache dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import check_kv_pages, pdl_enter, pdl_kwargs, pdl_trigger


@triton.jit
def _write_kv_kernel(
    K,  # [T, Hkv, D]
    V,  # [T, Hkv, D]
    KCache,  # [N, BS, Hkv, D]
    VCache,  # [N, BS, Hkv, D]
    Slots,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
    CHAIN: tl.constexpr,
):
    pdl_enter(CHAIN, PDL)  # PDL: the attention kernel after this one may start; it waits
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)  # [BH, BD]
        dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
        dst_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]
        k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        tl.store(KCache + dst_offs, k.to(KCache.dtype.element_ty), mask=mask)
        tl.store(VCache + dst_offs, v.to(VCache.dtype.element_ty), mask=mask)


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 marks a padding token that is not stored
) -> None:
    """``cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]`` (and v) for every ``t`` with a slot >= 0.

    ``k`` and ``v`` may be strided views (e.g. slices of a fused QKV projection) as long as the
    head dim is contiguous; the caches must share one layout with a contiguous head dim.
    """
    t, hkv, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    check_kv_pages(k_cache, v_cache, hkv, d)
    if slot_mapping.shape != (t,) or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be int64 [{t}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("the head dim of k and v must be contiguous")
    page = k_cache.shape[1]
    if t == 0:
        return
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=hkv, HEAD_DIM=d, PAGE=page,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d),
        PDL=pdl_trigger(k.device), **pdl_kwargs(k.device),
        num_warps=4 if hkv * d >= 1024 else 2,
    )  # fmt: skip
