"""Flash-Decoding over the paged KV cache (Triton): one query token per sequence.

For sequence ``b`` and query head ``h`` (KV head ``h // G``, ``G = Hq / Hkv``)::

    out[b, h] = sum_j softmax_j(s[b, h, j]) V[b, j],   lo[b] <= j < seq_lens[b]
    lse[b, h] = log sum_j exp(s[b, h, j])
    s[b, h, j] = scale * q[b, h] . K[b, j], or softcap * tanh(scale * q[b, h] . K[b, j] / softcap)

with ``lo[b] = max(0, seq_lens[b] - window)`` for a sliding window (``window > 0``), else 0.

One kernel (``_decode_split_kernel``), grid ``(B, Hkv, S)``: program ``(b, g, s)`` takes the
``G`` query heads of KV head ``g`` together (each KV byte is read once), walks split ``s`` of
the sequence's KV through its block table, and writes that split's normalised partial output
and LSE. The last of the ``S`` programs of ``(b, g)`` to finish (an atomic counter per
``(b, g)`` tells it) merges the ``S`` partials by their LSEs into the output, so a call is one
launch. With ``S == 1`` the program writes the output directly.

Sliding windows are block-sparse: the ``S`` splits divide ``[lo[b] rounded down to a KV tile,
seq_lens[b])``, which each program computes from the sequence length it reads (CUDA graphs),
so a row reads the pages of its last ``window`` tokens and nothing left of them: neither their
block-table entries nor their K/V (those pages may be back in the pool, holding anything). The
split plan sizes the grid by the tokens a row can read, ``min(max_seq_len, window)``, so the
work and the grid follow the window, not the context. Windows and soft-capping are constexpr
switches: without them the kernel compiles as before.

CUDA graphs: the grid depends only on host ints (``B``, ``max_seq_len``). Each program reads its
sequence length from device memory; by default the ``S`` splits divide each sequence evenly, so
a graph captured for a long ``max_seq_len`` still spreads a short sequence over all its splits.
Splits with no work write an LSE of -inf, which the merge ignores. ``split_size=`` fixes the
split length instead (the same reduction order whatever the batch: batch-invariant mode). The
merge counters live in a per-device buffer that every launch leaves zeroed (the merging
program resets its counter), so replays need no memset; calls on one device must not overlap.

An fp8 cache (``float8_e4m3fn`` pages with per-(token, KV head) scales, ``kernels.kv_quant``;
the ``FP8`` constexpr) is dequantized as its tiles are loaded, never in a pass of its own:
each tile's K and V scales (``[N, Hkv, PAGE]`` pools: 64 contiguous bf16 per page run and
head) are loaded beside it, and the dots run in f16 with float32 accumulation (never an fp8
dot): e4m3 values are exact in f16 and sm_90 converts them two at a time (to bf16 only
through f16, one value at a time), so bf16 and fp16 queries are converted to f16 once per
program, scaled by a power of two that makes any bf16 query fit f16's range
(``common.f16_queries``); float32 queries (tests) take float32 tiles and dots. The K scales
multiply the score columns (``s[:, n] *= k_scale[n]``, folded into the softmax scale: one
multiply a score, as before) and the V scales the columns of P before the P.V dot (times
``V_SCALE_SHIFT``, which keeps them out of f16's subnormals, divided out of the output). The
output and LSE keep the queries' dtype and float32. Without fp8 the kernel compiles as
before.

Tuning is a value, ``DecodeTuning`` (``tuning=``; ``DEFAULT_DECODE_TUNING`` holds the measured
choices, ``DEVICE_DECODE_TUNING`` those of GPUs that measured otherwise, which a call with no
``tuning`` takes on such a GPU); variants that lost their measurements are gone, their numbers kept
in docs/benchmarks/kernels-notes.md ("Deleted variants"). On sm_90+ the kernel uses programmatic
dependent launch: it is scheduled while its predecessor (``rope_write_kv``) runs and waits for it
in-kernel (``gdc_wait``) before touching memory; with ``chain=`` (the decode layer's PDL chain,
``kernels.common``) it first asks L2 for each split's first KV tile where its cache takes that
(``DecodeTuning.prefetch_for``: fp8 caches and head dims over 128; the cache's earlier rows, the
block tables and lengths are the step's inputs, there before the step starts), then waits, and lets
the next kernel launch once its KV loop is done.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.common import (
    SplitCounters,
    check_cache_dtypes,
    check_kv_pages,
    check_window_softcap,
    f16_queries,
    measured_for,
    measured_on,
    pdl_wait,
    softcap_factors,
    softcap_log2,
)
from kernels.common import num_sms as _num_sms
from kernels.kv_quant import V_SCALE_SHIFT, is_fp8

_LOG2E = 1.4426950408889634
_V_SHIFT = tl.constexpr(V_SCALE_SHIFT)  # a jit function reads constexpr globals only


@triton.jit
def _tile_pages(bt, n0, lo, end, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """Block-table entries of the KV tile at token ``n0`` (int64): one scalar when the tile
    lies in one page, else the tile's BN / PAGE entries, each loaded once and repeated per
    token [BN] (H100, B=1/4K: 11.4 µs; one entry load per token: 11.9). Pages at or past
    ``end`` read nothing (0), nor (WINDOWED) pages wholly left of ``lo``; a tile in one page
    holds a token at or past ``lo`` (tiles start at ``lo`` rounded down to BLOCK_N)."""
    if PAGE >= BLOCK_N:
        return tl.load(bt + n0 // PAGE, mask=n0 < end, other=0).to(tl.int64)
    else:
        idx = n0 // PAGE + tl.arange(0, BLOCK_N // PAGE)
        live = idx * PAGE < end
        if WINDOWED:
            live = live & ((idx + 1) * PAGE > lo)
        ent = tl.load(bt + idx, mask=live, other=0).to(tl.int64)
        return tl.reshape(tl.broadcast_to(ent[:, None], (BLOCK_N // PAGE, PAGE)), (BLOCK_N,))


@triton.jit
def _tile_scales(KS, VS, pages, n0, stride_sb, s_head, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """FP8: the K and V scales (bf16 [BN]) of the KV tile at token ``n0``, its block-table
    entries in ``pages`` (``_tile_pages``). Runs of min(PAGE, BN) contiguous offsets, each from a
    multiple of it (block and head strides are multiples of PAGE, tiles start at multiples of
    BN), which the compiler cannot see through the entries: told here, and loaded unmasked
    (every offset is in the pool: entries of dead pages, and of the tile past the end, read
    0). Masked or without the hint they load 2 bytes a thread, synchronously in the loop; so
    they do where a tile has one scale a thread, which the kernel then loads a tile ahead
    itself (``scales_ahead``; sm_90, Triton 3.6 and 3.9, 16-token pages: TTGIR)."""
    srow = pages * stride_sb + s_head + (n0 + tl.arange(0, BLOCK_N)) % PAGE  # [BN]
    if PAGE < BLOCK_N:
        srow = tl.max_contiguous(tl.multiple_of(srow, PAGE), PAGE)
    else:
        srow = tl.max_contiguous(tl.multiple_of(srow, BLOCK_N), BLOCK_N)
    return tl.load(KS + srow), tl.load(VS + srow)


@triton.jit
def _prefetch_rows(ptrs, nbytes):
    """Asks L2 for ``nbytes`` from each pointer of ``ptrs`` (sm_90's bulk prefetch; each
    pointer 16-byte aligned, ``nbytes`` a multiple of 16): a hint, with no result to wait
    for; L2 is where the GPU's writes meet, so a row written after it reads the write."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
        [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_split(K, V, bt, start, stop, lo, end, stride_kb, stride_kt, head_off,
                    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                    WINDOWED: tl.constexpr):  # fmt: skip
    """Prefetch into L2 the K and V rows of the tiles from ``start`` (a multiple of BLOCK_N)
    up to ``stop``: one bulk prefetch per token row of this program's KV head. Tokens past
    ``end`` in a live page read rows of that page; dead pages' entries read 0 (page 0):
    every address is in the pool."""
    offs_n = tl.arange(0, BLOCK_N)
    nbytes = tl.full([BLOCK_N], HEAD_DIM * K.dtype.element_ty.primitive_bitwidth // 8, tl.int32)
    for n0 in range(start, stop, BLOCK_N):
        pages = _tile_pages(bt, n0, lo, end, PAGE, BLOCK_N, WINDOWED)
        row = pages * stride_kb + ((n0 + offs_n) % PAGE) * stride_kt + head_off  # [BN]
        _prefetch_rows(K + row, nbytes)
        _prefetch_rows(V + row, nbytes)


@triton.jit
def _opaque_f16(x):
    """``x`` (f16) through an identity the compiler cannot see into: a PTX ``mov`` per pair of
    values, which ptxas deletes. Triton keeps the ops that computed ``x`` on its side of it."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                     is_pure=False, pack=2)  # fmt: skip


@triton.jit
def _attend_tile(
    q, K, V, k_sc, v_sc, pages, n0, lo, end, m_i, l_i, acc, offs_n, offs_d, d_mask, stride_kb,
    stride_kt, head_off, qk_scale, cap_in, cap_out, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Online softmax over one KV tile at token ``n0`` (its block-table entries in ``pages``;
    tokens at or past ``end``, and left of ``lo`` when WINDOWED, masked: never loaded): the
    updated (m_i, l_i, acc). SOFTCAP: scores soft-capped (``softcap_log2``). FP8: K and V
    are e4m3 with the tile's scales ``k_sc``/``v_sc`` (bf16 [BN], ``_tile_scales``); ``acc``
    then carries a factor ``V_SCALE_SHIFT``."""
    kv = n0 + offs_n  # [BN] token positions
    row = pages * stride_kb + (kv % PAGE) * stride_kt + head_off  # [BN]
    kv_mask = kv < end
    if WINDOWED:
        kv_mask = kv_mask & (kv >= lo)
    ld_mask = kv_mask[:, None] & d_mask[None, :]  # [BN, BD]
    k = tl.load(K + row[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)
    v = tl.load(V + row[:, None] + offs_d[None, :], mask=ld_mask, other=0.0)
    if FP8:
        k_sc = k_sc.to(tl.float32)
        v_sc = tl.where(kv_mask, v_sc.to(tl.float32), 0.0)  # 0 past the end
        k = k.to(q.dtype)  # exact
        v = v.to(q.dtype)
        if PTX and q.dtype == tl.float16:
            # The P.V dot takes V with its tokens along the reduction: Triton 3.6 would move
            # the conversion past the tile's shared-memory load into the dot's operand layout,
            # where a thread gathers its e4m3 bytes one at a time (64 ld.shared.b8 and their
            # packing per 64-token tile). Kept here, the f16 tile goes through shared memory
            # once more and ldmatrix.trans transposes it: sm_90 SASS of the loop at (64, 4, 4)
            # 893 -> 598 instructions per tile, shared memory +16 KB; tl.where on V's rows
            # pins it too, for 822 (docs/benchmarks/fp8.md).
            v = _opaque_f16(v)
    if SOFTCAP:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BG, BN]
        if FP8:
            s = s * k_sc[None, :]
        s = softcap_log2(s, cap_in, cap_out)  # log2 units
    elif FP8:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * (k_sc * qk_scale)[None, :]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BG, BN], log2
    s = tl.where(kv_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        pv = p * (v_sc * _V_SHIFT)[None, :]
    else:
        pv = p
    acc = tl.dot(pv.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _merge_splits(
    PartOut,  # [B, Hq, S, D] fp32
    PartLse,  # [B, Hq, S] fp32
    Out,  # [B, Hq, D]
    Lse,  # [B, Hq] fp32
    b,
    head0,  # the first of the NH heads merged here
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    NH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORE_LSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s), for NH heads.

    One pass over the splits in chunks of BLOCK_S with a running max: one round trip per
    chunk, the partial loads not waiting on the LSE loads. Chunks past the last non-empty split
    change nothing (weight 0, scale exactly 1), so with a fixed BLOCK_S the result does not
    depend on the number of splits. Loads bypass L1 (``.cg``): other programs of this grid
    wrote the partials.
    """
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    heads = head0 + offs_h  # [BH]
    h_mask = offs_h < NH
    d_mask = offs_d < HEAD_DIM
    lse_base = PartLse + b * stride_plb + heads[:, None] * stride_plh  # [BH, 1]
    part_base = PartOut + b * stride_pb + heads[:, None, None] * stride_ph + offs_d[None, None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        idx = s0 + offs_s  # [BS]
        live = h_mask[:, None] & (idx[None, :] < num_splits)  # [BH, BS]
        lse = tl.load(lse_base + idx[None, :], mask=live, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            part_base + idx[None, :, None] * stride_ps,
            mask=live[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [BH, BS, BD]; empty splits hold zeros
        m_new = tl.maximum(m, tl.max(lse, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing yet: keep exp() finite
        rescale = tl.exp(m - m_ref)  # [BH]
        w = tl.exp(lse - m_ref[:, None])  # [BH, BS]
        acc = acc * rescale[:, None] + tl.sum(w[:, :, None] * part, 1)
        denom = denom * rescale + tl.sum(w, 1)
        m = m_new
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]  # seq_len 0: output 0
    o_ptrs = Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if STORE_LSE:
        lse = m + tl.log(tl.where(h_mask, denom, 1.0))  # seq_len 0: -inf
        tl.store(Lse + b * stride_lb + heads * stride_lh, lse, mask=h_mask)


@triton.jit
def _decode_split_kernel(
    Q,  # [B, Hq, D]
    K,  # [N, PAGE, Hkv, D]
    V,  # [N, PAGE, Hkv, D]
    KS,  # [N, Hkv, PAGE] (FP8): K's scales
    VS,  # [N, Hkv, PAGE] (FP8): V's scales
    SeqLens,  # [B] int32
    BlockTables,  # [B, M] int32
    PartOut,  # [B, Hq, S, D] fp32 partials, or Out itself (DIRECT)
    PartLse,  # [B, Hq, S] fp32 partials, or Lse itself (DIRECT)
    Out,  # [B, Hq, D]: the last program of each (b, g) merges into it
    Lse,  # [B, Hq] fp32 (STORE_LSE)
    Counters,  # [B * Hkv] int32, zero between launches (not DIRECT)
    qk_scale,  # scale * log2(e)
    cap_in,  # SOFTCAP: 2 * scale * log2(e) / softcap
    cap_out,  # SOFTCAP: softcap * log2(e)
    window,  # WINDOWED: each row reads its last `window` tokens
    num_splits,  # S, a runtime int: one compiled kernel serves every batch size
    min_split,  # tokens; each split is at least this long (a multiple of BLOCK_N)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,  # FP8: the scale pools' block stride (head stride PAGE, token stride 1)
    stride_btb,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    DIRECT: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PDL_WAIT: tl.constexpr,
    CHAIN: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_H: tl.constexpr,
    MERGE_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PTX: tl.constexpr,  # compiled for an NVIDIA GPU: inline PTX (the interpreter runs none)
    SCALES_AHEAD: tl.constexpr,  # FP8: load each tile's scales a tile ahead (_tile_scales)
    PREFETCH: tl.constexpr,  # PDL_WAIT: tokens of the split prefetched into L2 before the wait
):
    if PDL_WAIT and PREFETCH == 0:  # launched early (PDL): the previous kernel's outputs are
        tl.extra.cuda.gdc_wait()  # ready after this
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + b)
    if WINDOWED:  # the row's KV from its window's first token, whole tiles from there
        lo = tl.maximum(seq_len - window, 0)
        base = lo // BLOCK_N * BLOCK_N
    else:
        lo = 0
        base = 0
    # split length: S even parts of the row's KV, rounded up to whole tiles
    split_len = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    split_len = tl.maximum(split_len, min_split)
    start = base + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    bt = BlockTables + b.to(tl.int64) * stride_btb
    head_off = hkv.to(tl.int64) * stride_kh
    if PDL_WAIT and PREFETCH > 0:
        # Launched while the kernels before it run (PDL; the RoPE kernel lets it launch before
        # its own wait): the step's inputs (lengths, block tables) and the cache's earlier rows
        # are there already, so the split's first tiles go to L2 now, during the QKV GEMV's
        # last wave and the RoPE kernel, and the loop below finds them there (measured:
        # DecodeTuning.prefetch_for). Only the new token's row is written meanwhile (by
        # the RoPE kernel), which L2 keeps coherent.
        stop = tl.minimum(end, start + PREFETCH)
        _prefetch_split(K, V, bt, start, stop, lo, end, stride_kb, stride_kt, head_off,
                        HEAD_DIM, PAGE, BLOCK_N, WINDOWED)  # fmt: skip
        tl.extra.cuda.gdc_wait()

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    heads = hkv * GROUP + offs_g  # [BG]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_ptrs = Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BG, BD]
    if FP8 and q.dtype != tl.float32:  # f16 dots (module doc); float32 queries stay exact
        q, q_unit = f16_queries(q)
        qk_scale = qk_scale * q_unit
        cap_in = cap_in * q_unit

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # The block-table entries of each tile are loaded one tile ahead (carried in `pages`): the
    # K/V addresses of a tile never wait on a block-table load issued in the same iteration,
    # and the pipeliner keeps num_stages - 1 K/V tiles in flight (Triton 3.6, sm_90: 2 buffers
    # at 3 stages, 71.7 KB smem; 3 at 4, 104.4 KB; entries loaded in the loop: 1 buffer at any
    # num_stages, 2 loads two tiles ahead: no pipelining at all).
    pages = _tile_pages(bt, start, lo, end, PAGE, BLOCK_N, WINDOWED)
    # FP8: each tile's scales (_tile_scales), copied ahead with the K/V tiles by Triton's
    # pipeliner, or (SCALES_AHEAD) loaded a tile ahead here, beside the entries
    k_sc, v_sc = 0.0, 0.0
    if SCALES_AHEAD:
        k_sc, v_sc = _tile_scales(KS, VS, pages, start, stride_sb, hkv * PAGE, PAGE, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):  # n0 is a multiple of BLOCK_N
        nxt = _tile_pages(bt, n0 + BLOCK_N, lo, end, PAGE, BLOCK_N, WINDOWED)
        k_tile, v_tile = k_sc, v_sc
        if SCALES_AHEAD:
            k_sc, v_sc = _tile_scales(KS, VS, nxt, n0 + BLOCK_N, stride_sb, hkv * PAGE, PAGE,
                                      BLOCK_N)  # fmt: skip
        elif FP8:
            k_tile, v_tile = _tile_scales(KS, VS, pages, n0, stride_sb, hkv * PAGE, PAGE,
                                          BLOCK_N)  # fmt: skip
        m_i, l_i, acc = _attend_tile(
            q, K, V, k_tile, v_tile, pages, n0, lo, end, m_i, l_i, acc, offs_n, offs_d, d_mask,
            stride_kb, stride_kt, head_off, qk_scale, cap_in, cap_out,
            PAGE=PAGE, BLOCK_N=BLOCK_N, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, FP8=FP8,
            DOT_PRECISION=DOT_PRECISION, PTX=PTX,
        )  # fmt: skip
        pages = nxt
    # The PDL chain: the next kernel may launch now that the KV is read (it waits). At the
    # kernel's start instead, its programs held SM slots beside this one's: H100, 11-13%
    # slower at 6 of 8 points (B=1/16K 32.0 µs vs 29.0, 8/4K 57.7 vs 51.7; kernels-notes.md).
    if CHAIN:
        tl.extra.cuda.gdc_launch_dependents()

    empty = l_i == 0.0  # a split with no tokens: output 0, LSE -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FP8:
        out = out * (1.0 / _V_SHIFT)  # a power of two: exact
    lse = (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453  # natural log
    lse = tl.where(empty, float("-inf"), lse)
    o_ptrs = PartOut + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps
    o_mask = g_mask[:, None] & d_mask[None, :]
    l_ptrs = PartLse + b.to(tl.int64) * stride_plb + heads * stride_plh + split
    if DIRECT:
        tl.store(o_ptrs + offs_d[None, :], out.to(PartOut.dtype.element_ty), mask=o_mask)
        if STORE_LSE:
            tl.store(l_ptrs, lse, mask=g_mask)
    else:
        tl.store(o_ptrs + offs_d[None, :], out, mask=o_mask)
        tl.store(l_ptrs, lse, mask=g_mask)
        # The last of the S programs of (b, hkv) to finish merges all S partials: a barrier
        # (every thread's partial stores issued), then one acq_rel atomic at GPU scope
        # (releases them; the last one acquires everyone else's).
        tl.debug_barrier()
        counter = Counters + b * tl.num_programs(1) + hkv
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            tl.store(counter, 0)  # zero again for the next launch (CUDA-graph replays)
            _merge_splits(
                PartOut, PartLse, Out, Lse, b.to(tl.int64), hkv * GROUP, num_splits,
                stride_pb, stride_ph, stride_ps, stride_plb, stride_plh,
                stride_ob, stride_oh, stride_lb, stride_lh,
                NH=GROUP, HEAD_DIM=HEAD_DIM, STORE_LSE=STORE_LSE, BLOCK_H=MERGE_H,
                BLOCK_S=MERGE_S, BLOCK_D=BLOCK_D,
            )  # fmt: skip


# ---- tuning (measurements: docs/benchmarks/kernels.md and kernels-notes.md, H100 unless said,
# µs per call under CUDA graph replay, Llama-3-8B heads, bf16; `python -m kernels.bench --sweep`)

_SMEM_PER_SM = 228 << 10  # sm_90; each resident program also holds 1 KB of the driver's
_SMEM_PER_BLOCK = 232_448  # sm_90: the most one program may ask (227 KB)
_FIXED_CHUNK = 16  # splits merged per step in split_size mode: the order never depends on S
_TILES_16BIT = (64, 4, 4)  # decode_config's over 16-bit caches at head dims up to 128


@dataclass(frozen=True)
class DecodeTuning:
    """The decode kernel's tuning choices, passed to the launcher as one value
    (``decode_attention(tuning=...)``); ``DEFAULT_DECODE_TUNING`` holds the measured ones.
    ValueError on construction for values the kernel cannot run."""

    # Stage 1's (BLOCK_N, num_warps, num_stages) for every call; None: decode_config's rule.
    tiles: tuple[int, int, int] | None = None
    # decode_config's tiles for head dims over 128 (Gemma 2/3: 256). H100, B=1, 16/8 heads
    # of 256, µs (kernels-notes.md, 2026-11-24):
    # (64, 4, 3) 17.2-17.4 at 4K, 96.0 at 32K, 9.0 over a 1,024-token window; (32, 4, 4)
    # 18.2-20.2 / 96.5 / 13.0 (at 256-token splits); (64, 4, 2) 14.7 over the window at
    # 256-token splits, (64, 8, 3) and (32, 8, 3) 1-20% slower, (16, 4, *) up to 45%.
    wide_tiles: tuple[int, int, int] = (64, 4, 3)
    # Stage 1's tiles over an fp8 cache read with f16 dots (16-bit queries; head dims up to
    # 128, wider ones take wide_tiles), at every split length; None: decode_config's, the
    # 16-bit caches' rule. H100, `kernels.bench --kv-dtype fp8 --sweep decode-config` (graph
    # replay, µs at B=1/128K, B=8/16K (273 MB each), B=32/128K; docs/benchmarks/fp8.md,
    # 2026-11-27): (128, 4, 3) 109.4 / 109.3 / 3,178 (83 / 83 / 91% of the copy bandwidth),
    # with its scales loaded a tile ahead (``scales_ahead``); (128, 8, 3) 118.0 / 118.7 /
    # 3,229; (64, 4, 4) 120.5 / 124.2 / 3,706; the rest of the sweep slower still. A 128-token
    # e4m3 tile carries a 64-token bf16 tile's bytes.
    fp8_tiles: tuple[int, int, int] | None = (128, 4, 3)
    # decode_config's 16-bit tiles with a pipeline stage fewer, for a plan whose splits are
    # longer than short_split_tokens[0] and at most short_split_tokens[1] tokens (the plan's
    # length: a CUDA graph's comes from max_model_len); None: never. Engine runs (bench
    # decode dummy:llama3.1-8b, batch 1, ms a step, (64, 4, 4) / (64, 4, 3); decode.md,
    # tensor-parallel.md): H200 TP=2 32K (512-token splits) 3.30 / 3.23 (2026-11-27), H100
    # 32K (1,024) 7.06 / 6.98; lost at 128K's 2,018-4,096-token splits (H200 TP=1 7.87 /
    # 8.05, TP=2 4.73 / 4.84, H100 11.2 / 11.5) and 4K's 128 (9.5 / 10.1 us a call). Since
    # the L2 prefetch went (session 21) under 1%: H100 16K 6.240 / 6.190, 32K 6.929 / 6.908;
    # two H100s TP=2 32K 4.099 / 4.086 (2026-11-28, decode.md).
    short_split_tiles: tuple[int, int, int] | None = (64, 4, 3)
    short_split_tokens: tuple[int, int] = (128, 1024)
    # Stage 1's tiles over 16-bit caches at head dims up to 128 (decode_config's class) where a
    # call's rows (batch x KV heads) are at most the SM count, so that the split heuristic
    # gives each SM one program of them; None: decode_config's (and short_split_tiles). Not
    # in split_size mode (its tiles never depend on the batch). Set per GPU where measured
    # (``decode_tuning_for``). H200, `kernels.bench` graph replay, page 128, µs, today's plan /
    # (128, 4, 3) (2026-11-28, docs/benchmarks/decode.md session 29): 32/8 heads B=1 4K 9.85 /
    # 9.41, 32K 37.1 / 35.5, 128K 125.9 / 123.8; B=2/32K 66.2 / 65.9, B=4/32K 125.1 / 123.4,
    # B=8/16K 124.9 / 123.0, B=16/32K 477.7 / 468.1, B=16/4K 65.8 / 62.8; 256 rows (B=32/4K)
    # 123.2 / 125.5 (a second wave); 16/4 heads (TP=2) B=1 32K 23.9 / 21.4, 128K 68.7 / 66.4.
    # bench decode dummy:llama3.1-8b batch 1, ms a step, cf1a527 / these tiles: TP=1 32K 5.087 /
    # 5.033, 128K 7.937 / 7.876, 4K level; TP=2 fused 32K 3.189 / 3.136, 128K 4.664 / 4.573.
    few_rows_tiles: tuple[int, int, int] | None = None
    # Stage-1 programs per SM the split heuristic aims for, never more than fit at once (a
    # second, mostly empty wave costs 20-30%: H200, B=8/16K, 8 splits 132 µs, 12 splits 168).
    # (64, 4, 3), B=1: 2 per SM (32 splits) beat 3 per SM (48) at 4K 12.3 / 13.1 µs, 16K 29.4
    # / 31.7, 64K 95.0 / 98.8; B=32/4K: 1 split (256 programs) 184 µs, 2 splits (512) 195.
    programs_per_sm: int = 2
    # Tokens per split at least (the heuristic only). H100, 2026-11-27 (`kernels.bench --sweep
    # splits`, graph replay, µs, 16 / 32 splits): B=1/4K bf16 (64, 4, 3) 11.6 / 10.3, fp8
    # (128, 4, 3) 11.6 / 11.0; end to end (bench decode, dummy:llama3.1-8b, batch 1, 4K, 256
    # against 128 alternated twice, docs/benchmarks/decode.md) 5.68, 5.68 / 5.65, 5.66 ms a
    # step, fp8 cache 5.68 / 5.66; 32K (32 splits either way) level. It was 256 (an older
    # kernel: 16 splits 11.8, 32 12.3, 64 of 64 tokens 15.8).
    min_split_tokens: int = 128
    # The same for head dims over 128: a 1,024-token window (Gemma 3's local layers), B=1,
    # 16/8 heads of 256: 64-token splits 9.0 µs, 128 10.4, 256 12.0; global 4K and 32K level
    # (17.4 / 95.7-96.0 at 64, 128 and 256).
    wide_min_split_tokens: int = 64
    max_splits: int = 256  # the heuristic's cap on splits per sequence
    # Tokens of each split prefetched into L2 before the in-kernel wait of a chained launch
    # (``_prefetch_split``), rounded up to whole tiles; 0: none. By the cache, as the tiles
    # are (``prefetch_for``): 16-bit caches at head dims up to 128, over 128 (``wide_``), fp8
    # read with f16 dots (``fp8_``). H100, bench decode batch 1, ms a step at 4K / 32K / 128K,
    # 64 tokens / none (docs/benchmarks/decode.md, 2026-11-27, session 21): Llama 3.1 8B
    # bf16 5.667 / 5.672, 7.063 / 6.914, 11.18 / 11.048 (another call: 5.675 / 5.658, 7.069
    # / 6.926, 11.189 / 11.047); Qwen3 8B 5.833 / 5.839, 7.372 / 7.236, 12.003 / 11.883;
    # Gemma 3 12B (head dim 256) 8.902 / 8.956, 9.512 / 9.539 (4K / 32K); Llama fp8 cache
    # 5.651 / 5.646, 6.275 / 6.295, 8.404 / 8.42; fp8 weights and cache 3.813 / 3.837, 4.415
    # / 4.458, 6.569 / 6.596. H200, earlier (4K / 32K): Gemma 3 none 6.614 / 7.023, 64 6.577
    # / 6.978, 256 6.684 / 7.082; Qwen3 4.395 / 5.315, 4.374 / 5.280, 4.609 / 5.446: a tile a
    # split helped there, whole 4K contexts in L2 ahead of the QKV GEMV's last wave cost up
    # to 5%.
    prefetch_tokens: int = 0
    wide_prefetch_tokens: int = 64
    fp8_prefetch_tokens: int = 64
    # Programmatic dependent launch (sm_90+): stage 1 is launched while the kernel before it
    # (rope_write_kv, which triggers early) runs, and waits for it in-kernel. On / off, fused
    # merge: B=1/4K 12.3 / 12.5, 16K 30.7 / 31.0, B=8/4K 53.2 / 53.6 (kernels-notes.md run 5).
    pdl: bool = True

    def __post_init__(self) -> None:
        if self.tiles is not None:
            object.__setattr__(self, "tiles", tuple(self.tiles))
            _check_tiles(self.tiles)
        object.__setattr__(self, "wide_tiles", tuple(self.wide_tiles))
        _check_tiles(self.wide_tiles, "wide_tiles")
        for name in ("fp8_tiles", "short_split_tiles", "few_rows_tiles"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
                _check_tiles(getattr(self, name), name)
        if self.short_split_tiles and self.short_split_tiles[0] != _TILES_16BIT[0]:
            raise ValueError(f"DecodeTuning.short_split_tiles {self.short_split_tiles}: BLOCK_N "
                             f"must be the 16-bit tiles' {_TILES_16BIT[0]} (the plan's splits "
                             "are counted in it)")  # fmt: skip
        lo, hi = self.short_split_tokens
        if not 0 <= lo <= hi:
            raise ValueError(f"DecodeTuning.short_split_tokens {self.short_split_tokens}: "
                             "(shortest excluded, longest included) with 0 <= shortest <= "
                             "longest")  # fmt: skip
        for name in ("programs_per_sm", "min_split_tokens", "wide_min_split_tokens", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeTuning.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prefetch_tokens", "wide_prefetch_tokens", "fp8_prefetch_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"DecodeTuning.{name} must be >= 0, got {getattr(self, name)}")

    def prefetch_for(self, head_dim: int, f16_dots: bool) -> int:
        """Tokens a split prefetches into L2 before its wait: head dims over 128 take
        ``wide_prefetch_tokens``, an fp8 cache read with f16 dots ``fp8_prefetch_tokens``,
        the rest ``prefetch_tokens`` (``decode_config``'s classes)."""
        if head_dim > 128:
            return self.wide_prefetch_tokens
        return self.fp8_prefetch_tokens if f16_dots else self.prefetch_tokens


def _check_tiles(tiles: tuple, field: str = "tiles") -> None:
    """(BLOCK_N, num_warps, num_stages): BLOCK_N a power of two >= 16 (``tl.dot``), num_warps a
    power of two, num_stages >= 1."""
    block_n, warps, stages = tiles if len(tiles) == 3 else (0, 0, 0)
    if not (block_n >= 16 and _is_pow2(block_n) and _is_pow2(warps) and stages >= 1):
        raise ValueError(f"DecodeTuning.{field} {tiles}: (BLOCK_N, num_warps, num_stages) with "
                         "BLOCK_N a power of two >= 16, num_warps a power of two, "
                         "num_stages >= 1")  # fmt: skip


def scales_ahead(fp8: bool, block_n: int, num_warps: int) -> bool:
    """Whether stage 1 loads an fp8 tile's scales a tile ahead itself (``SCALES_AHEAD``) rather
    than leave them to Triton's pipeliner: where a tile has one scale per thread
    (``block_n == 32 * num_warps``: 2 bytes, under cp.async's 4), which the pipeliner left
    synchronous in the loop, every tile waiting on two global loads (sm_90, Triton 3.6 and 3.9:
    (128, 4, 2-4) at head dims 64, 128 and 256); every other config of the fp8 sweep has them
    copied ahead with the K/V tiles. Loaded a tile ahead the SASS per tile is level (3.9: 850
    -> 849 at (128, 4, 3), head dim 128; 3.6: 911 -> 928)."""
    return fp8 and block_n == 32 * num_warps


def _is_pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


DEFAULT_DECODE_TUNING = DecodeTuning()
# The tuning of the GPUs whose measurements differ from DEFAULT_DECODE_TUNING's (H100), by a
# part of the device's name; the first that matches wins (``decode_tuning_for``).
DEVICE_DECODE_TUNING: tuple[tuple[str, DecodeTuning], ...] = (
    ("H200", DecodeTuning(few_rows_tiles=(128, 4, 3))),
)


def decode_tuning_for(device_name: str) -> DecodeTuning:
    """The measured tuning of a GPU of this name (``DEVICE_DECODE_TUNING``), else
    ``DEFAULT_DECODE_TUNING``."""
    return measured_for(device_name, DEVICE_DECODE_TUNING, DEFAULT_DECODE_TUNING)


class SplitPlan(NamedTuple):
    """How one call splits the KV: ``splits`` programs per (sequence, KV head), each split at
    least ``min_split`` tokens (a multiple of BLOCK_N), stage 1 compiled with ``tiles``."""

    splits: int
    min_split: int
    tiles: tuple[int, int, int]  # (BLOCK_N, num_warps, num_stages)


def decode_config(
    head_dim: int, tuning: DecodeTuning = DEFAULT_DECODE_TUNING, fp8: bool = False
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of stage 1, independent of the batch size (so that
    ``split_size=`` gives batch-invariant results). The block-table entries are loaded a tile
    ahead, so num_stages - 1 K/V tiles are in flight per program: 3 at (64, 4, 4) (104 KB of
    shared memory, 2 programs per SM). H100, 6 configs at 7 points (B 1-32, 4K-128K), each at
    its own heuristic split count: (64, 4, 4) fastest at 6, 1.2% behind (64, 4, 3) at B=8/4K;
    (64, 4, 3) 0-8% slower, (64, 4, 2) (one tile in flight) up to 28% (B=1/4K), BLOCK_N 32 or
    8 warps 1-31% slower (docs/benchmarks/kernels-notes.md). End to end a stage fewer wins
    at 129-1,024-token splits only: ``plan_splits`` takes ``tuning.short_split_tiles`` for
    plans of such splits (the measurements beside that field). Head dims over 128:
    ``tuning.wide_tiles``; an fp8 cache read with f16 dots: ``tuning.fp8_tiles`` when set."""
    if not _own_tiles(head_dim, fp8, tuning):
        return _TILES_16BIT
    return tuning.wide_tiles if head_dim > 128 else tuning.fp8_tiles


def _own_tiles(head_dim: int, fp8: bool, tuning: DecodeTuning) -> bool:
    """Whether a call takes tiles of its own class (head dims over 128: ``wide_tiles``; an
    fp8 cache read with f16 dots: ``fp8_tiles`` when set), not the 16-bit caches' that
    ``short_split_tiles`` and ``few_rows_tiles`` replace."""
    return head_dim > 128 or (fp8 and tuning.fp8_tiles is not None)


def fit_smem(
    config: tuple[int, int, int], head_dim: int, itemsize: int, fp8: bool = False
) -> tuple[int, int, int]:
    """``config`` with BLOCK_N halved (down to 16) until one program's shared memory fits the
    sm_90 limit: num_stages - 1 K and V tiles plus q and layout scratch. The measured tiles are
    for bf16/fp16; float32 caches (tests) at head dim 256 and (64, 4, 3) asked 282,688 bytes of
    232,448 (H100, Triton 3.6): (32, 4, 3) there. ``fp8``: as in ``plan_splits``."""
    block_n, warps, stages = config
    while block_n > 16 and _smem_bytes(block_n, stages, head_dim, itemsize, fp8) > _SMEM_PER_BLOCK:
        block_n //= 2
    return block_n, warps, stages


def _tile_bytes(block_n: int, stages: int, head_dim: int, itemsize: int, fp8: bool) -> int:
    """Shared memory of the K/V tiles: num_stages - 1 in flight, and over an fp8 cache (f16
    dots) the f16 V tile that ldmatrix transposes (``_attend_tile``)."""
    v16 = block_n * head_dim * 2 if fp8 else 0
    return max(1, stages - 1) * 2 * block_n * head_dim * itemsize + v16


def _smem_bytes(block_n: int, stages: int, head_dim: int, itemsize: int, fp8: bool = False) -> int:
    # scratch: 20.5 KB measured at head dim 256 in float32 (q [16, 256] and layout conversions)
    scratch = 16 * head_dim * itemsize + (8 << 10)
    return _tile_bytes(block_n, stages, head_dim, itemsize, fp8) + scratch


def programs_per_sm(
    config: tuple[int, int, int],
    head_dim: int,
    itemsize: int,
    tuning: DecodeTuning = DEFAULT_DECODE_TUNING,
    fp8: bool = False,
) -> int:
    """Stage-1 programs that fit on one SM at once (shared memory: the K/V tiles,
    ``_tile_bytes``, plus ~8 KB for q, P and layout scratch; 38.9 / 71.7 / 104.4 KB at (64, 4,
    2 / 3 / 4) on sm_90, Triton 3.6; fp8 at (64, 4, 4) 70.8, (128, 8, 3) 105.0), capped at
    ``tuning.programs_per_sm``."""
    block_n, _, stages = config
    smem = _tile_bytes(block_n, stages, head_dim, itemsize, fp8) + (9 << 10)
    return max(1, min(tuning.programs_per_sm, _SMEM_PER_SM // smem))


def num_splits_for(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    block_n: int,
    per_sm: int,
    tuning: DecodeTuning = DEFAULT_DECODE_TUNING,
    min_split_tokens: int | None = None,
) -> int:
    """Splits per sequence: the most that keep ``batch * num_kv_heads * splits`` stage-1
    programs within ``per_sm`` per SM, no split under ``min_split_tokens`` (None:
    ``tuning.min_split_tokens``), at most ``tuning.max_splits``, and every split the same whole
    number of tiles (none left empty by rounding)."""
    want = max(1, per_sm * num_sms // (batch * num_kv_heads))
    shortest = tuning.min_split_tokens if min_split_tokens is None else min_split_tokens
    tiles = math.ceil(max_seq_len / max(shortest, block_n))
    per_split = math.ceil(tiles / min(want, tiles, tuning.max_splits))
    return max(1, math.ceil(tiles / per_split))


def plan_splits(
    batch: int,
    num_kv_heads: int,
    head_dim: int,
    itemsize: int,
    max_seq_len: int,
    num_sms: int,
    tuning: DecodeTuning = DEFAULT_DECODE_TUNING,
    num_splits: int | None = None,
    split_size: int | None = None,
    window: int = 0,
    fp8: bool = False,
) -> SplitPlan:
    """The split count, minimum split length and stage-1 tiles of a call (see
    ``decode_attention`` for ``num_splits``, ``split_size`` and ``window``; ``itemsize``: the
    cache's bytes per element, ``fp8``: an fp8 cache read with f16 dots, i.e. by 16-bit queries;
    float32 queries, the tests', keep the 16-bit caches' tiles); host ints only, so the plan of
    a CUDA-graph capture holds for its replays.

    A row reads at most ``min(max_seq_len, window)`` tokens, which the heuristic sizes the
    splits by: a 4,096-token window at 128K gets the plan of a 4K context. A row's KV starts
    at its window's first token rounded down to a tile, so up to ``window + BLOCK_N - 1``
    tokens: the split count of ``split_size`` mode counts those, so that every split is
    ``split_size`` long whatever the row's alignment (batch invariance)."""
    # decode_config's 16-bit tiles, which the few rows' and the short splits' tiles replace
    replaceable = tuning.tiles is None and not _own_tiles(head_dim, fp8, tuning)
    few = (replaceable and tuning.few_rows_tiles is not None and split_size is None
           and batch * num_kv_heads <= num_sms)  # fmt: skip
    if few:
        tiles = fit_smem(tuning.few_rows_tiles, head_dim, itemsize, fp8)
    else:
        tiles = tuning.tiles or fit_smem(decode_config(head_dim, tuning, fp8), head_dim,
                                         itemsize, fp8)  # fmt: skip
    block_n = tiles[0]
    span = min(max_seq_len, window) if window > 0 else max_seq_len
    if split_size is not None:
        if split_size <= 0 or split_size % block_n:
            raise ValueError(f"split_size {split_size} must be a positive multiple of {block_n}")
        if window > 0:
            span = min(max_seq_len, window + block_n - 1)
        splits, min_split = max(1, math.ceil(span / split_size)), split_size
    elif num_splits is not None:  # split as asked
        splits, min_split = max(1, int(num_splits)), block_n
    else:
        wide = head_dim > 128
        shortest = tuning.wide_min_split_tokens if wide else tuning.min_split_tokens
        per_sm = programs_per_sm(tiles, head_dim, itemsize, tuning, fp8)
        splits = num_splits_for(batch, num_kv_heads, span, num_sms, block_n, per_sm, tuning,
                                shortest)  # fmt: skip
        # a graph captured for a long max_seq_len: a short sequence uses fewer, longer splits
        min_split = math.ceil(shortest / block_n) * block_n
    split_tokens = max(min_split, math.ceil(span / splits / block_n) * block_n)
    if replaceable and not few and _short_splits(split_tokens, tuning):
        tiles = fit_smem(tuning.short_split_tiles, head_dim, itemsize, fp8)
    return SplitPlan(splits, min_split, tiles)


def _short_splits(split_tokens: int, tuning: DecodeTuning) -> bool:
    """Whether a plan of ``split_tokens``-token splits on ``decode_config``'s 16-bit tiles
    takes ``tuning.short_split_tiles`` in their place."""
    lo, hi = tuning.short_split_tokens
    return tuning.short_split_tiles is not None and lo < split_tokens <= hi


# one per (sequence, KV head): the last stage-1 program of each merges the splits
_COUNTERS = SplitCounters("decode_attention", 1 << 14)
_split_counters = _COUNTERS.take
# Devices whose Triton refused a PDL launch of stage 1 (a Triton without ``launch_pdl``):
# plain launches there from then on. Only _launch_maybe_pdl adds to it.
_PDL_REFUSED: set[torch.device] = set()


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
    tuning: DecodeTuning | None = None,
    chain: bool = True,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
):
    """Decode attention of one query token per sequence over its paged KV (see module doc).

    ``max_seq_len`` bounds every ``seq_lens[b]`` (host int; from the block table's width if
    None): it sizes the grid and must not change between CUDA-graph replays. ``num_splits``
    overrides the split heuristic; ``split_size`` (a multiple of the KV tile: 64, or 128 over
    an fp8 cache with 16-bit queries, ``DecodeTuning.fp8_tiles``) fixes the tokens per split.
    ``tuning``: the kernel's tuning choices (``DecodeTuning``; None: the device's,
    ``decode_tuning_for``). ``chain``: join the decode layer's PDL chain where the device
    supports it (``kernels.common``).
    ``window`` > 0: each row attends to its last ``window`` tokens only (and reads only their
    pages); ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``; both are the
    layer's host values (0: off), fixed for a captured graph. An fp8 cache (``float8_e4m3fn``
    pages) comes with its scale pools ``k_scale``/``v_scale`` ``[N, Hkv, BS]``
    (``kernels.kv_quant``).
    Returns ``out`` [B, Hq, D], and ``lse`` [B, Hq] fp32 (natural log) if ``return_lse``.
    """
    bsz, hq, d = q.shape
    n_blocks, page, hkv, dk = k_cache.shape
    _check(q, k_cache, v_cache, seq_lens, block_tables, dk, hkv, k_scale, v_scale)
    window, softcap = check_window_softcap(window, softcap)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * page
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous head dim")
    lse = torch.empty((bsz, hq), dtype=torch.float32, device=q.device) if return_lse else None
    if bsz == 0:
        return (out, lse) if return_lse else out

    if tuning is None:
        tuning = measured_on(q.device, DEVICE_DECODE_TUNING, DEFAULT_DECODE_TUNING)
    itemsize = k_cache.element_size()
    fp8 = is_fp8(k_cache)
    f16_dots = fp8 and q.dtype != torch.float32  # the fp8 tiles' plan (plan_splits)
    plan = plan_splits(bsz, hkv, d, itemsize, max_seq_len, _num_sms(q.device), tuning,
                       num_splits, split_size, window, f16_dots)  # fmt: skip
    if plan.splits == 1:  # stage 1 writes the output
        part_out, part_lse = out, lse if return_lse else out.new_empty((1,), dtype=torch.float32)
        counters = part_lse  # unused
    else:
        part_out = torch.empty((bsz, hq, plan.splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, hq, plan.splits), dtype=torch.float32, device=q.device)
        counters = _split_counters(q.device, bsz * hkv)
    per_sm = programs_per_sm(plan.tiles, d, itemsize, tuning, f16_dots)
    scales = (k_scale, v_scale) if fp8 else None
    launch = functools.partial(
        _launch, q, k_cache, v_cache, scales, seq_lens, block_tables, part_out, part_lse, out,
        lse, counters, scale, window, softcap, plan, per_sm, return_lse, split_size is not None,
        chain, prefetch=tuning.prefetch_for(d, f16_dots),
    )  # fmt: skip
    _launch_maybe_pdl(q.device, tuning.pdl, launch)
    return (out, lse) if return_lse else out


def _launch_maybe_pdl(device: torch.device, want: bool, launch: Callable[..., None]) -> None:
    """``launch(pdl=...)``: with programmatic dependent launch where ``want``ed and ``device``
    supports it (``pdl_wait``, probed once per device). A Triton whose launcher refuses PDL
    fails the first such launch: warn, remember the device in ``_PDL_REFUSED``, and launch
    plainly, there and from then on."""
    pdl = want and pdl_wait(device) and device not in _PDL_REFUSED
    if not pdl:
        launch(pdl=False)
        return
    try:
        launch(pdl=True)
    except Exception as e:
        warnings.warn(
            f"decode: no programmatic dependent launch ({e}); plain launches", stacklevel=3
        )
        _PDL_REFUSED.add(device)
        launch(pdl=False)


def _merge_chunk(heads: int, block_d: int, fixed: bool, per_thread: int) -> int:
    """Splits merged per step: as many as keep ``per_thread`` fp32 partials per thread (4 warps;
    the merge takes that many whatever the split count is, so one compiled kernel serves every
    split count), or in split_size mode a number that does not depend on the split count
    (``_FIXED_CHUNK``), so that the merge order is fixed."""
    fit = max(1, triton.next_power_of_2(per_thread * 128 // (heads * block_d) + 1) // 2)
    return min(_FIXED_CHUNK, fit) if fixed else fit


def _merge_per_thread(per_sm: int, num_warps: int) -> int:
    """Partials per thread in one merge step: 128 (160 registers, sm_90, Triton 3.6) where the
    registers of ``per_sm`` resident programs allow it, else 64 (96 registers, the main loop's
    own count): at (64, 4, 3) the 3 programs that fit in shared memory can have 170 registers
    per thread, so a merge of 32 splits x 4 heads takes one round trip."""
    regs = 65536 // (per_sm * num_warps * 32)
    return 128 if regs >= 168 else 64


def _launch(
    q, k_cache, v_cache, scales, seq_lens, block_tables, part_out, part_lse, out, lse,
    counters, scale, window, softcap, plan, per_sm, return_lse, fixed, chain, *, prefetch, pdl,
):  # fmt: skip
    """Stage 1, merging in its last program per (sequence, KV head); launched early (PDL) when
    ``pdl``, and then letting the next kernel launch early too when ``chain``, and prefetching
    ``prefetch`` tokens a split before its wait (``DecodeTuning.prefetch_for``) when both.
    ``scales``: an fp8 cache's (k_scale, v_scale), else None."""
    bsz, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    block_n, num_warps, num_stages = plan.tiles
    group = hq // hkv
    direct = plan.splits == 1
    if direct:
        sp = (out.stride(0), out.stride(1), 0)
        spl = (lse.stride(0), lse.stride(1)) if return_lse else (0, 0)
    else:
        sp, spl = part_out.stride()[:3], part_lse.stride()[:2]
    sl = (lse.stride(0), lse.stride(1)) if return_lse else (0, 0)
    block_d = triton.next_power_of_2(d)
    merge_h = triton.next_power_of_2(group)
    merge_s = _merge_chunk(merge_h, block_d, fixed, _merge_per_thread(per_sm, num_warps))
    extra = {"launch_pdl": True} if pdl else {}
    row_bytes = d * k_cache.element_size()  # the bulk prefetch's unit: multiples of 16 bytes
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread without FP8
    _decode_split_kernel[(bsz, hkv, plan.splits)](
        q, k_cache, v_cache, k_scale, v_scale, seq_lens, block_tables, part_out, part_lse, out,
        lse if return_lse else part_lse, counters,
        scale * _LOG2E, *softcap_factors(scale, softcap), window, plan.splits, plan.min_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if scales else 0,
        block_tables.stride(0),
        *sp, *spl, out.stride(0), out.stride(1), *sl,
        GROUP=group, HEAD_DIM=d, PAGE=page, DIRECT=direct, STORE_LSE=return_lse,
        PDL_WAIT=pdl, CHAIN=pdl and chain,  # pdl: the device has gdc_wait (pdl_chain's test)
        WINDOWED=window > 0, SOFTCAP=softcap > 0, FP8=scales is not None,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        MERGE_H=merge_h, MERGE_S=merge_s,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        PTX=q.is_cuda and torch.version.hip is None,
        SCALES_AHEAD=scales_ahead(scales is not None, block_n, num_warps),
        PREFETCH=triton.cdiv(prefetch, block_n) * block_n if pdl and chain and row_bytes % 16 == 0
        else 0,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )  # fmt: skip


def _check(q, k_cache, v_cache, seq_lens, block_tables, d, hkv, k_scale, v_scale):
    if q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q {tuple(q.shape)} must be [B, Hq, {d}]")
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {hkv} KV heads")
    check_kv_pages(k_cache, v_cache, hkv, d)
    check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    if q.stride(2) != 1:
        raise ValueError("the head dim of q must be contiguous")
    if seq_lens.dtype != torch.int32 or block_tables.dtype != torch.int32:
        raise ValueError("seq_lens and block_tables must be int32")
    if block_tables.dim() != 2 or block_tables.shape[0] < q.shape[0]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be [B, M]")
    if seq_lens.shape[0] < q.shape[0] or block_tables.stride(1) != 1:
        raise ValueError("seq_lens must be [B]; block_tables rows contiguous")
