"""Flash-Decoding over the paged KV cache (Triton): one query token per sequence.

For sequence ``b`` and query head ``h`` (KV head ``h // G``, ``G = Hq / Hkv``)::

    out[b, h] = sum_j softmax_j(scale * q[b, h] . K[b, j]) V[b, j],   j < seq_lens[b]
    lse[b, h] = log sum_j exp(scale * q[b, h] . K[b, j])

Stage 1 (``_decode_split_kernel``), grid ``(B, Hkv, S)``: program ``(b, g, s)`` takes the ``G``
query heads of KV head ``g`` together (each KV byte is read once), walks split ``s`` of the
sequence's KV through its block table, and writes that split's normalised partial output and
LSE. Stage 2 (``_decode_combine_kernel``), grid ``(B, Hq)``, merges the splits by their LSEs.
With ``S == 1`` stage 1 writes the output directly and stage 2 is skipped.

CUDA graphs: the grid depends only on host ints (``B``, ``max_seq_len``). Each program reads its
sequence length from device memory; by default the ``S`` splits divide each sequence evenly, so
a graph captured for a long ``max_seq_len`` still spreads a short sequence over all its splits.
Splits with no work write an LSE of -inf, which the combine ignores. ``split_size=`` fixes the
split length instead (the same reduction order whatever the batch: batch-invariant mode).

On sm_90+ both kernels use programmatic dependent launch: each is scheduled while its
predecessor runs and waits for it in-kernel (``gdc_wait``) before touching memory.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    Q,  # [B, Hq, D]
    K,  # [N, PAGE, Hkv, D]
    V,  # [N, PAGE, Hkv, D]
    SeqLens,  # [B] int32
    BlockTables,  # [B, M] int32
    Out,  # [B, Hq, D] (DIRECT) or [B, Hq, S, D] fp32 partials
    Lse,  # [B, Hq] fp32 (DIRECT) or [B, Hq, S] fp32 partials
    qk_scale,  # scale * log2(e)
    num_splits,  # S, a runtime int: one compiled kernel serves every batch size
    min_split,  # tokens; each split is at least this long (a multiple of BLOCK_N)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    DIRECT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PDL: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if PDL:  # the combine may be scheduled now; it waits for this grid's results itself
        tl.extra.cuda.gdc_launch_dependents()
    if PDL_WAIT:  # launched early (PDL): the previous kernel's outputs are ready after this
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    # split length: S even parts of this sequence, rounded up to whole tiles
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hkv * GROUP + offs_g  # [BG]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BG, BD]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt = BlockTables + b.to(tl.int64) * stride_btb
    head_off = hkv.to(tl.int64) * stride_kh
    for n0 in range(start, end, BLOCK_N):  # n0 is a multiple of BLOCK_N
        kv = n0 + offs_n  # [BN] token positions
        kv_mask = kv < end
        if PAGE >= BLOCK_N:  # the tile lies in one page
            page = tl.load(bt + n0 // PAGE).to(tl.int64)
        else:
            page = tl.load(bt + kv // PAGE, mask=kv_mask, other=0).to(tl.int64)
        row = page * stride_kb + (kv % PAGE) * stride_kt + head_off  # [BN]
        ld_mask = kv_mask[:, None] & d_mask[None, :]
        k = tl.load(K + row[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)  # [BN, BD]
        v = tl.load(V + row[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)  # [BN, BD]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BG, BN], log2
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    empty = l_i == 0.0  # a split with no tokens: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
    o_mask = g_mask[:, None] & d_mask[None, :]
    l_ptrs = Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split
    if DIRECT:
        tl.store(o_ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=o_mask)
        if STORE_LSE:
            tl.store(l_ptrs, lse, mask=g_mask)
    else:
        tl.store(o_ptrs + offs_d[None, :], out, mask=o_mask)
        tl.store(l_ptrs, lse, mask=g_mask)


@triton.jit
def _decode_combine_kernel(
    PartOut,  # [B, Hq, S, D] fp32
    PartLse,  # [B, Hq, S] fp32
    Out,  # [B, Hq, D]
    Lse,  # [B, Hq] fp32
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    stride_fb,
    stride_fh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    STORE_LSE: tl.constexpr,
    USE_PDL: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s).

    One pass over the splits in chunks of BLOCK_S with a running max; the partial loads do not
    wait on the LSE loads. Chunks past the last non-empty split change nothing (weight 0, scale
    1), so with a fixed BLOCK_S the result does not depend on the number of splits.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    lse_base = PartLse + b * stride_lb + h * stride_lh
    part_base = PartOut + b * stride_pb + h * stride_ph
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # launched early (PDL): wait until stage 1 is done and visible
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), 0)
    denom = tl.sum(tl.zeros([BLOCK_S], tl.float32), 0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        idx = s0 + offs_s  # [BS]
        live = idx < num_splits
        lse = tl.load(lse_base + idx, mask=live, other=float("-inf"))  # -inf: empty split
        part = tl.load(
            part_base + idx[:, None] * stride_ps + offs_d[None, :],
            mask=live[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BS, BD]; empty splits hold zeros
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: keep exp() finite
        rescale = tl.exp(m - m_ref)
        w = tl.exp(lse - m_ref)  # [BS]
        acc = acc * rescale + tl.sum(w[:, None] * part, 0)
        denom = denom * rescale + tl.sum(w, 0)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)  # seq_len 0: every split empty, output 0
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask
    )
    if STORE_LSE:
        tl.store(Lse + b * stride_fb + h * stride_fh, m + tl.log(denom))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: keep grids small
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---- tuning (measurements: docs/benchmarks/kernels.md, `python -m kernels.bench --sweep`)

# Stage-1 programs per SM the split heuristic aims for, never more: all programs must be resident
# at once (one wave; (64, 4, 2) fits 5 per SM). H200, B=32 at 4K: 2 splits (512 programs) 134 µs,
# 3 splits (768: a second, mostly empty wave) 160 µs; B=8 at 16K: 8 splits 132 µs, 12: 168 µs.
_PROGRAMS_PER_SM = 4
_MIN_SPLIT_TOKENS = 64  # at least one KV tile per split
_MAX_SPLITS = 256
_FIXED_CHUNK = 16  # splits merged per step in split_size mode: the order never depends on S
# Programmatic dependent launch (sm_90+): the combine is launched while stage 1 runs, and stage
# 1 while the previous kernel (write_kv, or the last layer's combine) runs; each waits on its
# predecessor in-kernel. H200, graph replay (none / combine / both): B=1/4K 13.4 / 12.1 / 11.9
# µs, B=1/16K 27.2 / 26.9 / 26.0; B=32/128K 3880 / 3900 / 3949 (one sample each).
_USE_PDL = True
_PDL_STAGE1 = True


def decode_config(head_dim: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of stage 1, independent of the batch size (so that
    ``split_size=`` gives batch-invariant results). H200, Llama-3-8B heads, 6 configs at 8
    points (B 1-32, 4K-128K): (64, 4, 2) fastest at 5, within 2% at 2, and 12.7 vs 12.0 µs
    for (32, 4, 2) at B=1/4K; BLOCK_N 128 is 8-17% slower from 16K up."""
    block_n = 64 if head_dim <= 128 else 32
    return block_n, 4, 2


def num_splits_for(
    batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int
) -> int:
    """Splits per sequence: the most that keep ``batch * num_kv_heads * splits`` stage-1
    programs within ``_PROGRAMS_PER_SM`` per SM, and no split under ``_MIN_SPLIT_TOKENS``."""
    want = _PROGRAMS_PER_SM * num_sms // (batch * num_kv_heads)
    most = math.ceil(max_seq_len / max(_MIN_SPLIT_TOKENS, block_n))
    return max(1, min(want, most, _MAX_SPLITS))


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    return (
        _USE_PDL
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
        and hasattr(tl.extra, "cuda")
        and hasattr(tl.extra.cuda, "gdc_wait")
    )


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    seq_lens: torch.Tensor,  # [B] int32, KV length including the new token
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    num_splits: int | None = None,
    split_size: int | None = None,
    config: tuple[int, int, int] | None = None,
):
    """Decode attention of one query token per sequence over its paged KV (see module doc).

    ``max_seq_len`` bounds every ``seq_lens[b]`` (host int; from the block table's width if
    None): it sizes the grid and must not change between CUDA-graph replays. ``num_splits``
    overrides the split heuristic; ``split_size`` (a multiple of the KV tile, 64) fixes the
    tokens per split. ``config`` = (BLOCK_N, num_warps, num_stages) overrides the tuning.
    Returns ``out`` [B, Hq, D], and ``lse`` [B, Hq] fp32 (natural log) if ``return_lse``.
    """
    bsz, hq, d = q.shape
    n_blocks, page, hkv, dk = k_cache.shape
    _check(q, k_cache, v_cache, seq_lens, block_tables, dk, hkv)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous head dim")
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None
    if bsz == 0:
        return (out, lse) if return_lse else out

    group = hq // hkv
    block_n, num_warps, num_stages = config or decode_config(d, group)
    min_split = block_n
    if split_size is not None:
        if split_size <= 0 or split_size % block_n:
            raise ValueError(f"split_size {split_size} must be a positive multiple of {block_n}")
        min_split = split_size
        splits = max(1, math.ceil(max_seq_len / split_size))
    elif num_splits is not None:
        splits = max(1, int(num_splits))
    else:
        splits = num_splits_for(bsz, hkv, max_seq_len, _num_sms(q.device), block_n)

    direct = splits == 1
    if direct:  # stage 1 writes the output
        part_out, part_lse = out, lse if return_lse else out.new_empty((1,), dtype=torch.float32)
    else:
        part_out = torch.empty((bsz, hq, splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, hq, splits), dtype=torch.float32, device=q.device)
    args = (q, k_cache, v_cache, seq_lens, block_tables, part_out, part_lse, out, lse)
    tiles = (block_n, num_warps, num_stages)
    pdl = _pdl_supported(q.device)
    try:
        _launch(*args, scale, splits, min_split, tiles, return_lse, bool(split_size), pdl)
    except Exception as e:
        if not pdl:
            raise
        warnings.warn(
            f"decode: no programmatic dependent launch ({e}); plain launches", stacklevel=2
        )
        global _USE_PDL
        _USE_PDL = False  # a Triton without PDL launches: plain launches from now on
        _pdl_supported.cache_clear()
        _launch(*args, scale, splits, min_split, tiles, return_lse, bool(split_size), False)
    return (out, lse) if return_lse else out


def _launch(
    q, k_cache, v_cache, seq_lens, block_tables, part_out, part_lse, out, lse,
    scale, splits, min_split, tiles, return_lse, fixed, pdl,
):  # fmt: skip
    """Stage 1, then (with several splits) the combine; both launched early when ``pdl``."""
    bsz, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    block_n, num_warps, num_stages = tiles
    direct = splits == 1
    if direct:
        so = (out.stride(0), out.stride(1), 0)
        sl = (lse.stride(0), lse.stride(1)) if return_lse else (0, 0)
    else:
        so, sl = part_out.stride()[:3], part_lse.stride()[:2]
    block_d = triton.next_power_of_2(d)
    stage1_extra = {"launch_pdl": True} if pdl and _PDL_STAGE1 else {}
    _decode_split_kernel[(bsz, hkv, splits)](
        q, k_cache, v_cache, seq_lens, block_tables, part_out, part_lse,
        scale * _LOG2E, splits, min_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        *so, *sl,
        GROUP=hq // hkv, HEAD_DIM=d, PAGE=page, DIRECT=direct, STORE_LSE=return_lse,
        PDL=pdl and not direct, PDL_WAIT=pdl and _PDL_STAGE1,
        BLOCK_G=max(16, triton.next_power_of_2(hq // hkv)), BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages, **stage1_extra,
    )  # fmt: skip
    if direct:
        return
    # splits merged per step: all of them (up to 64) for the fewest round trips, or a fixed 16
    # in split_size mode so that the merge order is the same for any number of splits
    chunk = _FIXED_CHUNK if fixed else min(64, triton.next_power_of_2(splits))
    fin_lse = lse if return_lse else part_lse
    extra = {"launch_pdl": True} if pdl else {}
    _decode_combine_kernel[(bsz, hq)](
        part_out, part_lse, out, fin_lse,
        *part_out.stride()[:3], *part_lse.stride()[:2],
        out.stride(0), out.stride(1),
        fin_lse.stride(0) if return_lse else 0, fin_lse.stride(1) if return_lse else 0,
        splits,
        HEAD_DIM=d, STORE_LSE=return_lse, USE_PDL=pdl, BLOCK_S=chunk, BLOCK_D=block_d,
        num_warps=8 if chunk * block_d >= 8192 else 4, **extra,
    )  # fmt: skip


def _check(q, k_cache, v_cache, seq_lens, block_tables, d, hkv):
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} must be [B, Hq, {d}]")
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} differ")
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head dim of q and the caches must be contiguous")
    page = k_cache.shape[1]
    if page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")
    if seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32:
        raise ValueError("seq_lens and block_tables must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] < q.shape[0]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [B, M]")
    if seq_lens.shape[0] < q.shape[0] or block_tables.stride(1) != 1:
        raise ValueError("seq_lens must be [B]; block_tables rows contiguous")
