"""An fp8 KV cache's pages dequantized into a 16-bit scratch pool, so that the Gluon prefill
kernel (which reads 16-bit pools only) prefills over an fp8 cache (``kernels.prefill``,
``path="auto"``).

Why a copy pays: over an fp8 cache the Hopper path converts every e4m3 K/V tile to f16 for
each 128-query tile that reads it, through shared memory: the first token of 128K (Llama-3-8B's
shape, H200) took 17.2 s that way and takes 10.9 s this way, where a bf16 cache's takes 10.66
on an H100 (docs/benchmarks/fp8.md, 2026-11-27). Dequantizing a
chunk's context once per layer costs its bytes instead: read 1 byte, write 2, read 2 back per
element, about 0.45 s over the 64 chunks of a 128K prompt of Llama-3-8B's shape at 3 TB/s
(the sum of the chunks' contexts, 4.1M tokens, times 2,048 elements a token a layer, times 5
bytes, times 32 layers).

``dequantize_pages`` writes, for each sequence ``b`` and each page ``j`` of its first
``seq_lens[b]`` tokens, ``K[b][j] * k_scale`` (and V) into scratch page ``b * P + j`` (``P``
pages a sequence), rounded to the scratch's dtype: the values a 16-bit cache would hold,
within its rounding (2^-9 relative in bf16, against e4m3's 2^-4). ``scratch_tables`` gives the
block table over it. Pages past a sequence's last are not written (the kernels read no page
past ``seq_lens``; slots past the end within the last page hold whatever the fp8 page held
there, which the kernels mask as they do over the cache itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_quant import check_kv_scales


@triton.jit
def _dequant_pages_kernel(
    K,  # [N, PAGE, Hkv, D] e4m3, through its strides (token rows or a head's rows together)
    V,
    KScale,  # [N, Hkv, PAGE] bf16, contiguous
    VScale,
    BlockTables,  # [B, M] int32
    SeqLens,  # [B] int32
    OutK,  # [B * P, PAGE, Hkv, D], contiguous
    OutV,
    pages_per_seq,  # P
    stride_n,
    stride_t,
    stride_h,
    stride_btb,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    ROWS: tl.constexpr,  # tokens a step
):
    j = tl.program_id(0)  # the sequence's page
    b = tl.program_id(1)
    h = tl.program_id(2)
    if j * PAGE < tl.load(SeqLens + b):
        entry = tl.load(BlockTables + b.to(tl.int64) * stride_btb + j).to(tl.int64)
        dst = (b * pages_per_seq + j).to(tl.int64) * PAGE
        offs_d = tl.arange(0, HEAD_DIM)
        for t0 in tl.static_range(0, PAGE, ROWS):
            offs_t = t0 + tl.arange(0, ROWS)
            src = entry * stride_n + offs_t[:, None] * stride_t + h * stride_h + offs_d[None, :]
            out = ((dst + offs_t[:, None]) * HKV + h) * HEAD_DIM + offs_d[None, :]
            s_off = (entry * HKV + h) * PAGE + offs_t
            ks = tl.load(KScale + s_off).to(tl.float32)[:, None]
            vs = tl.load(VScale + s_off).to(tl.float32)[:, None]
            k = tl.load(K + src).to(tl.float32) * ks
            v = tl.load(V + src).to(tl.float32) * vs
            tl.store(OutK + out, k.to(OutK.dtype.element_ty))
            tl.store(OutV + out, v.to(OutV.dtype.element_ty))


def scratch_tables(batch: int, pages_per_seq: int, device: torch.device) -> torch.Tensor:
    """The block table ``[batch, pages_per_seq]`` int32 over a scratch pool that
    ``dequantize_pages`` filled: sequence ``b``'s page ``j`` is scratch page ``b * P + j``."""
    n = batch * pages_per_seq
    return torch.arange(n, dtype=torch.int32, device=device).view(batch, pages_per_seq)


def dequantize_pages(
    k_cache: torch.Tensor,  # [N, PAGE, Hkv, D] float8_e4m3fn
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,  # [N, Hkv, PAGE] (kernels.kv_quant)
    v_scale: torch.Tensor,
    block_tables: torch.Tensor,  # [B, M] int32
    seq_lens: torch.Tensor,  # [B] int32
    pages_per_seq: int,  # P: covers every seq_lens[b]
    out_k: torch.Tensor,  # [>= B * P, PAGE, Hkv, D] 16-bit, contiguous
    out_v: torch.Tensor,
) -> None:
    """Each sequence's pages of its first ``seq_lens[b]`` tokens, dequantized into ``out_k``
    / ``out_v`` page ``b * P + j`` (module doc)."""
    if not check_kv_scales(k_cache, k_scale, v_scale):
        raise ValueError(f"dequantize_pages takes an fp8 cache, not {k_cache.dtype}")
    n, page, hkv, d = k_cache.shape
    bsz = seq_lens.shape[0]
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(3) != 1 or d & (d - 1) or page & (page - 1):
        raise ValueError(f"pages {tuple(k_cache.shape)}: a contiguous head dim and page and "
                         "head dim powers of two")  # fmt: skip
    if block_tables.shape[0] != bsz or block_tables.shape[1] < pages_per_seq:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [{bsz}, >= "
                         f"{pages_per_seq}]")  # fmt: skip
    want = (bsz * pages_per_seq, page, hkv, d)
    for name, o in (("out_k", out_k), ("out_v", out_v)):
        if o.shape[0] < want[0] or o.shape[1:] != want[1:] or not o.is_contiguous():
            raise ValueError(f"{name} must be contiguous [>= {want[0]}, {page}, {hkv}, {d}]; "
                             f"got {tuple(o.shape)}")  # fmt: skip
        if o.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name} must be bf16, fp16 or fp32, not {o.dtype}")
    if bsz == 0 or pages_per_seq == 0:
        return
    rows = max(1, min(page, 4096 // d))  # ~16 KB of float32 a step for K and for V
    _dequant_pages_kernel[(pages_per_seq, bsz, hkv)](
        k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, out_k, out_v,
        pages_per_seq, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), HKV=hkv, HEAD_DIM=d, PAGE=page, ROWS=rows, num_warps=4,
    )  # fmt: skip
