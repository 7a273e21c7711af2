"""FlashAttention-2 style causal prefill over the paged KV cache (Triton).

The batch is flattened: sequence ``b``'s query chunk is ``q[cu[b]:cu[b+1]]`` (``n`` tokens) and
its KV (``seq_lens[b]`` tokens, the chunk's own K/V included) lives in the paged cache. Query
``i`` of the chunk sits at position ``p_i = seq_lens[b] - n + i``; with ``G = Hq / Hkv``::

    out[t, h] = sum_{j in J_i} softmax_j(s[t, h, j]) V[b, j, h // G]
    lse[t, h] = log sum_{j in J_i} exp(s[t, h, j])
    s[t, h, j] = scale * q[t, h] . K[b, j, h // G]   (soft-capped: softcap * tanh(s / softcap))

with ``J_i = {j : j <= p_i}``, or ``{j : p_i - window < j <= p_i}`` with a sliding window. So
chunked prefill and prefix reuse (cached context before the chunk) need nothing special.

Grid ``(query tiles, Hq, B)``: each program owns ``BLOCK_M`` queries of one head of one
sequence, runs an online softmax in fp32 with ``exp2`` (the scale folded into
``qk_scale = scale * log2(e)``) over the KV tiles, first those that every query of the tile
sees in full (no mask), then the few tiles on the causal diagonal (masked); tiles past the
diagonal are never visited. Heavy tiles (late in the sequence) are launched first.

Sliding windows are block-sparse: a query tile's loop starts at the KV tile holding the first
key its FIRST query sees (``p - window + 1``); every tile wholly left of it is skipped, its
block-table entries and pages never read (they may be back in the pool, holding anything).
The few tiles on the window's left edge are masked like the diagonal's, the tiles between run
unmasked, so the work per query tile grows with the window, not the context. Windows and
soft-capping are constexpr switches: without them the kernel compiles as before.

An fp8 cache (the ``FP8`` constexpr; ``kernels.kv_quant``) is dequantized as tiles load, as in
``kernels.decode``: each K/V tile's per-token scales load beside it, the e4m3 tile converts
exactly to f16 for f16 dots (float32 accumulation; bf16 and fp16 queries scaled by a power of
two into f16 once per query tile, ``common.f16_queries``; float32 queries, in tests, take
float32 tiles), the K scales multiply the score columns and the V scales (times
``V_SCALE_SHIFT``) the columns of P. f16 rather than bf16 tiles because sm_90 converts e4m3 to
f16 two values an instruction and to bf16 only through f16 (H200, 16K tokens, the Hopper path
at 128-token pages: 261 -> 295 TFLOP/s; the first token of 128K 20.5 -> 17.0 s;
docs/benchmarks/fp8.md).

The Hopper path (sm_90, issue 17; ``path="hopper"``, or ``"auto"`` on an sm_90 GPU with pages
of >= 64 tokens) is the same kernel with two constexprs set. ``TMA``: K and V tiles arrive by
bulk tensor copies (``cp.async.bulk.tensor``) through host-built descriptors over the pools
viewed as rows of a token's stride (``pool_view``): ``[N * PAGE, Hkv * D]`` for token rows, a
tile at row ``block_table[page] * PAGE + offset`` and column ``kv_head * D``; ``[N * Hkv *
PAGE, D]`` for pools that keep a head's rows of a page together (``kv_quant.new_kv_pool``), at
row ``block_table[page] * Hkv * PAGE + kv_head * PAGE + offset`` and column 0. A tile is one
page's run of ``BLOCK_N`` rows (``PAGE >= BLOCK_N``), so no per-token address math or
per-thread copies are left in the loop. The copies cannot be masked:
a tile on the diagonal (or a window's left edge) may bring slots past the sequence's end (or
left of the window: anything, NaN included), so in those tiles the scores are masked as always
and the dead V rows zeroed before P @ V. ``PERSISTENT``: one
program per SM (``programs_per_sm``) loops over the work items (query tile, head, sequence),
heaviest tiles first, dealt out boustrophedon (program p takes item p of even waves and item
P - 1 - p of odd ones) so that every program gets about the same number of causal KV tiles
(a simulation of 4K tokens, 32 heads, 132 programs: the busiest program 0.2% over the mean,
against 12% dealing round-robin and 0.9% for the hardware's greedy order of a plain grid).
Triton 3.6 does not warp-specialize this loop on sm_90 (``tl.range(warp_specialize=True)``
is ignored with 8 warps and fails to compile with 4), so the overlap of copies and math comes
from software pipelining (``num_stages``). Head dims other than 64, 128, 256 stay on the
portable path. Over an fp8 cache (``FP8`` and ``TMA``) the copies bring e4m3 tiles (a
descriptor over the e4m3 pool, the same view: its rows are ``Hkv * D`` or ``D`` bytes,
16-byte aligned) and the tile's scales come beside them, one contiguous run of ``BLOCK_N``
per pool (a head's scales of a page are contiguous: ``[N, Hkv, PAGE]``): a bulk copy each
through a 1-D descriptor over the scale pool for tiles of >= 64 keys (``SCALE_TMA_MIN_N``),
cp.async for smaller ones, pipelined with the tiles; conversion and scaling are the portable
FP8 code's, and in the masked tiles the dead slots' scales are zeroed with their V rows
(either may be NaN).

``path="gluon"`` (and ``"auto"`` where it can run: ``_auto_gluon``) runs a separate kernel
written in Gluon, FlashAttention-3 style (``kernels.prefill_gluon``): a producer warp, two
consumer warpgroups in ping-pong, the softmax overlapping the next MMA. It shares this file's
pool view and ``hopper_refusal``, and refuses windows, soft-capping, fp8 and fp32
(``gluon_refusal``). Over an fp8 cache, ``"auto"`` given ``fp8_scratch`` dequantizes the
batch's pages into it and runs the Gluon kernel there (``_auto_gluon_fp8``,
``kernels.kv_dequant``: the first token of 128K 17.2 -> 10.9 s on an H200); a batch whose
pages exceed it runs in groups of sequences that fit (``_gluon_over_fp8``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.common import (
    PREFILL_STEP_INTS,
    check_cache_dtypes,
    check_window_softcap,
    f16_queries,
    num_sms,
    softcap_factors,
    softcap_log2,
)
from kernels.kv_dequant import dequantize_pages, scratch_tables
from kernels.kv_quant import V_SCALE_SHIFT, check_kv_scales, is_head_major
from kernels.prefill_paths import HOPPER_HEAD_DIMS, HOPPER_MIN_PAGE, PATHS, gluon_triton_refusal

if TYPE_CHECKING:
    from kernels.prefill_gluon import GluonConfig

try:  # host-side TMA descriptors (Triton >= 3.4); without them only the portable path runs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

_LOG2E = 1.4426950408889634
# A bulk copy lands at a 128-byte aligned shared address, so the scales' copies (2 bytes a key)
# take KV tiles of >= 64 keys; smaller tiles' scales come by cp.async (sm_90: misaligned address)
SCALE_TMA_MIN_N = 64
_SCALE_TMA_MIN_N = tl.constexpr(SCALE_TMA_MIN_N)  # a jit function reads constexpr globals only
_V_SHIFT = tl.constexpr(V_SCALE_SHIFT)  # a jit function reads constexpr globals only


@triton.jit
def _tile_row(bt, start, hi, page_rows, head_row, PAGE: tl.constexpr):
    """TMA: the row of the pool view (``pool_view``: ``page_rows`` rows a page, the KV head's
    first at ``head_row`` in each) where the KV tile at ``start`` begins (page 0 from ``hi``
    on: no block-table entry past the loop is read)."""
    entry = tl.load(bt + start // PAGE, mask=start < hi, other=0)
    return entry * page_rows + head_row + start % PAGE


@triton.jit
def _prefill_inner(
    acc,  # [BM, BD] fp32
    l_i,  # [BM] fp32
    m_i,  # [BM] fp32, running max in log2 units
    q,  # [BM, BD]
    K,  # pools [N, PAGE, Hkv, D], or (TMA) descriptors over them as [N * PAGE, Hkv * D]
    V,
    KS,  # FP8: the K and V scale pools [N, Hkv, PAGE], or (TMA) descriptors over them as one run
    VS,
    bt,  # this sequence's block-table row
    head_off,  # kv_head * stride_kh, or (TMA) the head's first column in the pool view
    head_row,  # TMA: the head's first row in a page of the pool view
    s_head,  # FP8: kv_head * PAGE, the head's offset in a page of scales
    lo,
    hi,  # KV positions [lo, hi), lo a multiple of BLOCK_N
    q_pos,  # [BM] positions of the queries
    seq_len,
    win_lo,  # WINDOWED: the first key the tile's first query sees; nothing left of it loads
    window,
    qk_scale,
    cap_in,
    cap_out,
    stride_kb,
    stride_kt,
    stride_sb,
    MASKED: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,  # TMA over pools of a head's rows (pool_view)
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of one query tile over KV tiles [lo, hi); MASKED applies the causal and
    sequence-end masks (the tiles on the diagonal), and with WINDOWED the window's (the tiles
    on its left edge; keys left of ``win_lo`` are not loaded), otherwise every key is visible.
    SOFTCAP: scores soft-capped (``softcap_log2``). FP8: e4m3 K/V with per-token scales;
    ``acc`` then carries a factor ``V_SCALE_SHIFT``. TMA: tiles by bulk copies (module doc)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if TMA:  # the pool view's rows a page (pool_view)
        if HEAD_MAJOR:
            page_rows = stride_kb // stride_kt  # Hkv * PAGE
        else:
            page_rows = PAGE
        next_row = _tile_row(bt, lo, hi, page_rows, head_row, PAGE)
    for start in range(lo, hi, BLOCK_N):
        kv = start + offs_n  # [BN]
        live = kv < seq_len
        if MASKED and WINDOWED:
            live = live & (kv >= win_lo)
        if TMA:  # one page's run of BLOCK_N rows: two bulk copies, no per-token addresses
            # (FP8: the run's scales, one contiguous vector each, below). The block-table entry
            # comes a tile ahead: with the copy's address loaded in the same iteration, Triton
            # 3.6's pipeliner keeps one copy in flight (2 buffers at any num_stages); from the
            # previous iteration's load, num_stages - 1 (sm90_compile).
            row = next_row
            next_row = _tile_row(bt, start + BLOCK_N, hi, page_rows, head_row, PAGE)
            k = K.load([row, head_off])  # [BN, BD]
            v = V.load([row, head_off])
            if FP8 and not HEAD_MAJOR:
                page = row // PAGE
        elif PAGE >= BLOCK_N:  # the whole tile lies in one page (one holding a key >= win_lo)
            page = tl.load(bt + start // PAGE).to(tl.int64)
            row = page * stride_kb + (kv % PAGE) * stride_kt + head_off  # [BN]
        else:
            page_live = live
            if FP8:  # a page's tokens take one entry: the scale loads are hinted contiguous
                # per page, so an entry masked token by token (a window starting mid-page)
                # would mix two pages in one hinted run (H100: a page-16 window read wrong
                # scales, rel err 0.97)
                first = kv // PAGE * PAGE  # [BN] each token's page start
                page_live = first < seq_len
                if MASKED and WINDOWED:
                    page_live = page_live & (first + PAGE > win_lo)
            page = tl.load(bt + kv // PAGE, mask=page_live, other=0).to(tl.int64)
            row = page * stride_kb + (kv % PAGE) * stride_kt + head_off
        if not TMA:
            ptrs = row[:, None] + offs_d[None, :]  # [BN, BD]
            if MASKED:
                ld_mask = live[:, None] & d_mask[None, :]
                k = tl.load(K + ptrs, mask=ld_mask, other=0.0)
                v = tl.load(V + ptrs, mask=ld_mask, other=0.0)
            elif HEAD_DIM == BLOCK_D:
                k = tl.load(K + ptrs)
                v = tl.load(V + ptrs)
            else:
                k = tl.load(K + ptrs, mask=d_mask[None, :], other=0.0)
                v = tl.load(V + ptrs, mask=d_mask[None, :], other=0.0)
        if FP8 and TMA and BLOCK_N >= _SCALE_TMA_MIN_N:  # a tile's scales are one run of the
            # scale pools [N, Hkv, PAGE]: one bulk copy each, copied ahead with the tiles
            # (per-thread cp.async in the MMA's layout moves 2 values a copy: ~200
            # instructions an iteration at d128, sm90_compile; H200: 293 -> 311 TFLOP/s at 16K)
            if HEAD_MAJOR:  # the scale pools have the view's rows
                s0 = row
            else:
                s0 = page * stride_sb + s_head + start % PAGE
            k_sc = KS.load([s0]).to(tl.float32)  # masked below with the scores
            v_sc = VS.load([s0]).to(tl.float32)
        elif FP8:  # hinted and unmasked, as in kernels.decode (every offset is in the pool)
            # TMA: copied ahead with the tiles (cp.async; no synchronous load in the loop)
            if TMA and HEAD_MAJOR:  # the scale pools [N, Hkv, PAGE] have the view's rows
                srow = row + offs_n
            else:
                srow = page * stride_sb + s_head + kv % PAGE  # [BN]
            if PAGE < BLOCK_N:
                srow = tl.max_contiguous(tl.multiple_of(srow, PAGE), PAGE)
            else:
                srow = tl.max_contiguous(tl.multiple_of(srow, BLOCK_N), BLOCK_N)
            k_sc = tl.load(KS + srow).to(tl.float32)  # masked below with the scores
            v_sc = tl.load(VS + srow).to(tl.float32)
        if FP8:
            if MASKED:  # past the end a slot's scale may be anything: 0 * NaN is NaN
                k_sc = tl.where(live, k_sc, 0.0)
                v_sc = tl.where(live, v_sc, 0.0)
            k = k.to(q.dtype)  # exact
            v = v.to(q.dtype)
        if TMA and MASKED:  # unmaskable copies: a dead slot may hold NaN, and 0 * NaN is NaN
            v = tl.where(live[:, None], v, 0.0)  # (its K columns and scales are masked too)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BM, BN]
        if FP8:
            s = s * k_sc[None, :]
        if SOFTCAP:
            s = softcap_log2(s, cap_in, cap_out)  # log2 units
        if MASKED:
            visible = (kv[None, :] <= q_pos[:, None]) & (kv[None, :] < seq_len)
            if WINDOWED:
                visible = visible & (kv[None, :] > q_pos[:, None] - window)
            if SOFTCAP:
                s = tl.where(visible, s, float("-inf"))
            else:
                s = tl.where(visible, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if WINDOWED:  # a row may have seen no key yet (left edge): keep exp2 finite
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_ref = m_new
            p = tl.exp2(s - m_ref[:, None])
        elif SOFTCAP:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_ref = m_new
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP8:
            p = p * (v_sc * _V_SHIFT)[None, :]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_tile(
    tile,  # the query tile: queries [tile * BLOCK_M, (tile + 1) * BLOCK_M) of the chunk
    h,  # query head
    b,  # sequence
    Q, K, V, KS, VS, CuSeqlensQ, SeqLens, BlockTables, Out, Lse,
    qk_scale, cap_in, cap_out, window,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_sb, stride_btb,
    stride_ot, stride_oh, stride_lt, stride_lh,
    split=0,  # SPLIT: this program's part of the keys before the diagonal (of n_splits)
    n_splits=1,
    stride_ps=0,  # SPLIT: Out and Lse are the parts' buffers [S, T, Hq, D] / [S, T, Hq]
    stride_pls=0,
    SPLIT: tl.constexpr = False,
    GROUP: tl.constexpr = 1,
    HEAD_DIM: tl.constexpr = 128,
    PAGE: tl.constexpr = 16,
    STORE_LSE: tl.constexpr = False,
    WINDOWED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    FP8: tl.constexpr = False,
    TMA: tl.constexpr = False,
    HEAD_MAJOR: tl.constexpr = False,  # TMA over pools of a head's rows (pool_view)
    BLOCK_M: tl.constexpr = 64,
    BLOCK_N: tl.constexpr = 64,
    BLOCK_D: tl.constexpr = 128,
    DOT_PRECISION: tl.constexpr = "tf32",
):  # fmt: skip
    """One work item: a query tile of one head of one sequence (nothing past the chunk). With
    SPLIT, only part ``split`` of the ``n_splits`` parts of the tiles before the diagonal (the
    last part takes the diagonal too), its normalized output and LSE into part ``split`` of
    Out and Lse (an empty part: LSE -inf, output 0)."""
    q_start = tl.load(CuSeqlensQ + b)
    q_len = tl.load(CuSeqlensQ + b + 1) - q_start
    m0 = tile * BLOCK_M
    if m0 < q_len:
        seq_len = tl.load(SeqLens + b)
        ctx = seq_len - q_len  # cached tokens before the chunk

        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < q_len
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)  # [BM] token index in the flattened batch
        q = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BM, BD]
        if FP8 and q.dtype != tl.float32:  # f16 dots (module doc); float32 queries stay exact
            q, q_unit = f16_queries(q)
            qk_scale = qk_scale * q_unit
            cap_in = cap_in * q_unit
        q_pos = ctx + offs_m  # [BM]

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt = BlockTables + b.to(tl.int64) * stride_btb
        if TMA and HEAD_MAJOR:  # the head's first row in a page, column 0 (pool_view)
            head_row = (h // GROUP) * PAGE
            head_off = 0
        elif TMA:  # row 0 of a page, the head's first column
            head_row = 0
            head_off = (h // GROUP) * HEAD_DIM
        else:
            head_row = 0
            head_off = (h // GROUP).to(tl.int64) * stride_kh
        s_head = (h // GROUP) * PAGE
        # keys before the tile's first query are visible to all its queries (causally)
        full_end = (ctx + m0) // BLOCK_N * BLOCK_N
        last = True
        if SPLIT:  # this part's run of those tiles (no window: the launcher does not split)
            n_full = full_end // BLOCK_N
            full_lo = split * n_full // n_splits * BLOCK_N
            full_end = (split + 1) * n_full // n_splits * BLOCK_N
            last = split == n_splits - 1
        else:
            full_lo = 0
        if WINDOWED:
            # Skip the tiles wholly left of the first query's window; mask those that some
            # query's window cuts (up to the first key that the tile's last query sees).
            win_lo = tl.maximum(ctx + m0 - window + 1, 0)
            all_lo = tl.maximum(ctx + m0 + BLOCK_M - window, 0)
            mid = tl.minimum(tl.cdiv(all_lo, BLOCK_N) * BLOCK_N, full_end)
            acc, l_i, m_i = _prefill_inner(
                acc, l_i, m_i, q, K, V, KS, VS, bt, head_off, head_row, s_head,
                win_lo // BLOCK_N * BLOCK_N, mid, q_pos, seq_len, win_lo, window, qk_scale,
                cap_in, cap_out, stride_kb, stride_kt, stride_sb, MASKED=True, WINDOWED=True,
                SOFTCAP=SOFTCAP, FP8=FP8, TMA=TMA,
                HEAD_MAJOR=HEAD_MAJOR, PAGE=PAGE, HEAD_DIM=HEAD_DIM,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip
        else:
            win_lo = 0
            mid = full_lo
        acc, l_i, m_i = _prefill_inner(
            acc, l_i, m_i, q, K, V, KS, VS, bt, head_off, head_row, s_head, mid, full_end,
            q_pos, seq_len, win_lo, window, qk_scale, cap_in, cap_out, stride_kb, stride_kt,
            stride_sb, MASKED=False, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, FP8=FP8, TMA=TMA,
            HEAD_MAJOR=HEAD_MAJOR,
            PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        # the diagonal: up to the tile's last query
        diag_end = tl.minimum(ctx + m0 + BLOCK_M, seq_len)
        if not last:  # another part's
            diag_end = full_end
        acc, l_i, m_i = _prefill_inner(
            acc, l_i, m_i, q, K, V, KS, VS, bt, head_off, head_row, s_head, full_end, diag_end,
            q_pos, seq_len, win_lo, window, qk_scale, cap_in, cap_out, stride_kb, stride_kt,
            stride_sb, MASKED=True, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, FP8=FP8, TMA=TMA,
            HEAD_MAJOR=HEAD_MAJOR,
            PAGE=PAGE, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
            DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip

        if SPLIT:  # an empty part: l_i 0, output 0, LSE -inf
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            Out += split.to(tl.int64) * stride_ps
            Lse += split.to(tl.int64) * stride_pls
        else:
            out = acc / l_i[:, None]
        if FP8:
            out = out * (1.0 / _V_SHIFT)  # a power of two: exact
        tl.store(
            Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )
        if STORE_LSE or SPLIT:
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # natural log (-inf where empty)
            tl.store(Lse + rows * stride_lt + h * stride_lh, lse, mask=m_mask)


@triton.jit(do_not_specialize=(*PREFILL_STEP_INTS, "n_splits", "stride_ps", "stride_pls"))
def _prefill_kernel(
    Q,  # [T, Hq, D]
    K,  # [N, PAGE, Hkv, D], or (TMA) a descriptor over it as [N * PAGE, Hkv * D]
    V,  # [N, PAGE, Hkv, D], or (TMA) a descriptor over it as [N * PAGE, Hkv * D]
    KS,  # [N, Hkv, PAGE] (FP8): K's scales, or (TMA) a descriptor over them as one run
    VS,  # [N, Hkv, PAGE] (FP8): V's scales
    CuSeqlensQ,  # [B+1] int32
    SeqLens,  # [B] int32
    BlockTables,  # [B, M] int32
    Out,  # [T, Hq, D]
    Lse,  # [T, Hq] fp32
    qk_scale,
    cap_in,  # SOFTCAP: 2 * scale * log2(e) / softcap
    cap_out,  # SOFTCAP: softcap * log2(e)
    window,  # WINDOWED: a query at p sees keys p - window < j <= p
    n_tiles,  # PERSISTENT: query tiles of the longest chunk
    n_heads,  # PERSISTENT: Hq
    n_seqs,  # PERSISTENT: B
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_sb,  # FP8: the scale pools' block stride
    stride_btb,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    n_splits,  # SPLIT: parts of each query tile's keys (grid axis 2: B * n_splits)
    stride_ps,  # SPLIT: Out / Lse are the parts' buffers [S, T, Hq, D] / [S, T, Hq]
    stride_pls,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    STORE_LSE: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    FP8: tl.constexpr,
    TMA: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,  # TMA over pools of a head's rows (pool_view)
    PERSISTENT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    if PERSISTENT:  # work items (tile, head, sequence), heavy tiles first, heads fastest
        pid = tl.program_id(0)
        progs = tl.num_programs(0)
        per_row = n_heads * n_seqs
        n_items = n_tiles * per_row
        for first in range(0, n_items, progs):  # a wave: items [first, first + progs)
            # boustrophedon: the program that took a wave's heaviest item takes the next
            # wave's lightest, so the causal work evens out (module doc)
            item = first + tl.where(first // progs % 2 == 0, pid, progs - 1 - pid)
            if item < n_items:
                _prefill_tile(
                    n_tiles - 1 - item // per_row, item % n_heads, item % per_row // n_heads,
                    Q, K, V, KS, VS, CuSeqlensQ, SeqLens, BlockTables, Out, Lse,
                    qk_scale, cap_in, cap_out, window, stride_qt, stride_qh, stride_kb,
                    stride_kt, stride_kh, stride_sb, stride_btb, stride_ot, stride_oh,
                    stride_lt, stride_lh, GROUP=GROUP, HEAD_DIM=HEAD_DIM, PAGE=PAGE,
                    STORE_LSE=STORE_LSE, WINDOWED=WINDOWED, SOFTCAP=SOFTCAP, FP8=FP8, TMA=TMA,
                    HEAD_MAJOR=HEAD_MAJOR,
                    BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                    DOT_PRECISION=DOT_PRECISION,
                )  # fmt: skip
    else:  # grid (query tiles, Hq, B [* n_splits]), heavy (late) tiles first
        if SPLIT:
            b = tl.program_id(2) // n_splits
            split = tl.program_id(2) % n_splits
        else:
            b = tl.program_id(2)
            split = 0
        _prefill_tile(
            tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1), b,
            Q, K, V, KS, VS, CuSeqlensQ, SeqLens, BlockTables, Out, Lse,
            qk_scale, cap_in, cap_out, window, stride_qt, stride_qh, stride_kb, stride_kt,
            stride_kh, stride_sb, stride_btb, stride_ot, stride_oh, stride_lt, stride_lh,
            split, n_splits, stride_ps, stride_pls, SPLIT=SPLIT,
            GROUP=GROUP, HEAD_DIM=HEAD_DIM, PAGE=PAGE, STORE_LSE=STORE_LSE, WINDOWED=WINDOWED,
            SOFTCAP=SOFTCAP, FP8=FP8, TMA=TMA,
            HEAD_MAJOR=HEAD_MAJOR, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip


def prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), the best of a sweep on an H200 (Triton 3.6,
    causal, 32/8 heads, bf16; `python -m kernels.bench --sweep`): head dim 128, 16K tokens:
    (128, 128, 8, 2) 432 TFLOP/s, (128, 64, 8, 3) 380, (64, 64, 4, 3) 320 at 4K; head dim 64,
    4K: (128, 64, 8, 3) 274; head dim 256, 4K: (128, 64, 8, 2) 423, (64, 32, 4, 2) 310."""
    if dtype == torch.float32:
        return 32, 32, 4, 1  # ieee fp32 dots: small tiles (tests, not speed)
    if head_dim <= 64:
        return 128, 64, 8, 3
    if head_dim <= 128:
        return 128, 128, 8, 2
    return 128, 64, 8, 2


HOPPER_SMEM = 225 << 10  # H100: 227 KiB of shared memory per block, less barriers and scratch


def hopper_config(
    head_dim: int, dtype: torch.dtype, page: int, fp8: bool = False
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, programs_per_sm) of the Hopper path: the
    portable sweep's tiles with the KV tile cut to the page (a tile is one page's run), as
    many copy stages as shared memory holds beside the query tile (up to 4: at d128, (128,
    128) gets 3 stages in 230,416 bytes and (128, 64) 4 in 164,888, sm90_compile), one
    persistent program per SM (at d128 its 8 warps of 207-240 registers fill most of the
    register file); at d64 two programs an SM of 64-query tiles. bf16 on the H100
    (2026-11-27): 480 / 512 TFLOP/s at 4K / 16K with 128-token pages. An fp8 cache takes the
    same config (H200: 270 / 311 TFLOP/s, docs/benchmarks/fp8.md): its stages are half the
    bytes, plus one K/V tile converted to f16 (164,896 bytes at d128, page 128), but more
    stages buy no registers
    (255 at d128 with 128-key tiles; with the scales by bulk copy Triton 3.6 spills there, an
    80-byte stack and 16-20 local accesses a KV-loop iteration, and still measured 6% faster
    than without: sm90_compile, fp8.md). ``python -m kernels.bench --sweep hopper [--kv-dtype
    fp8]`` on the H100 (2026-11-27, docs/benchmarks/kernels.md), µs, default / best of the
    sweep: bf16 d128 page 128 4K 285.3, the best; 16K 3,996 / 3,908 (a plain grid, which is
    9% slower at 4K); page 64 within 0.5%; d256 617.0 / 607.6 (64, 64, 4, 3, 1); d64 page 64
    257.4 / 202.8 (two programs an SM; Gluon takes d64 bf16 caches where it can, 205.2). fp8
    d128 page 128 (the fp8 default) 4K the best, 16K 6,915 / 6,886; d256 1,119 / 1,073 (a
    plain grid); d64 380.0 / 339.0 (64, 64, 4, 4, 2). So d64 takes (64, 64, 4, 4, 2), the
    fp8 best and bf16's second (220.0 where the one-program default took 257.4; (128, 64, 8,
    4, 2) 202.8 is level with the old default over fp8, 380.7). d128 at the pages the engine
    gives it is within 0.5% of the best. d256 (Gemma 2/3, whose windows take this path): bf16
    keeps the default (1.5% behind (64, 64, 4, 3, 1), which loses 25% over fp8); over an fp8
    cache (``fp8``) the same tiles run as a plain grid (1,073.2 where persistent took
    1,118.6; at d128 the plain grid loses 11% at 4K)."""
    if dtype == torch.float32:
        return 32, min(32, page), 4, 1, 1  # ieee fp32 dots: small tiles (tests, not speed)
    bm, bn, warps, _ = prefill_config(head_dim, dtype)
    per_sm = 1
    if head_dim <= 64:  # 64-query tiles of 4 warps, two programs an SM (the sweep above)
        bm, warps, per_sm = 64, 4, 2
    elif head_dim > 128 and fp8:  # a plain grid (the sweep above)
        per_sm = 0
    bn = min(bn, page)
    size = dtype.itemsize
    stages = (HOPPER_SMEM // max(per_sm, 1) - bm * head_dim * size) // (2 * bn * head_dim * size)
    return bm, bn, warps, max(1, min(stages, 4)), per_sm


def hopper_refusal(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_n: int) -> str | None:  # fmt: skip
    """Why the Hopper path cannot take these inputs with KV tiles of ``block_n`` keys; None if
    it can (on an sm_90+ GPU, or in the interpreter)."""
    _, page, _, d = k_cache.shape
    if TensorDescriptor is None:
        return "this Triton has no tensor descriptors (triton.tools.tensor_descriptor)"
    if q.is_cuda and torch.cuda.get_device_capability(q.device)[0] != 9:
        # its tiles fill the H100's 227 KiB of shared memory a block (sm_120 has ~99 KiB)
        return "the Hopper path is sized for sm_90 (H100/H200): TMA copies, 227 KiB of smem"
    if d not in HOPPER_HEAD_DIMS:
        return f"head dim {d}: the Hopper path takes {HOPPER_HEAD_DIMS}"
    if page < block_n:
        return f"page {page} < BLOCK_N {block_n}: a KV tile must lie in one page"
    if block_n < 16:
        return f"BLOCK_N {block_n}: P @ V needs at least 16 keys a tile"
    if is_head_major(k_cache):
        hkv = k_cache.shape[2]
        if k_cache.stride()[:3] != (hkv * page * d, d, page * d):
            return "pools of a head's rows must be dense [N, Hkv, PAGE, D] storage"
    elif k_cache.stride(2) != d or k_cache.stride(0) != page * k_cache.stride(1):
        return "the pools must be rows of [N * PAGE, Hkv * D] (pages of whole token rows)"
    if (k_cache.stride(1) * k_cache.element_size()) % 16 or any(
        x.data_ptr() % 16 for x in (k_cache, v_cache)
    ):
        return "bulk tensor copies need 16-byte aligned pools and rows"
    return None


def pool_view(pool: torch.Tensor) -> tuple[list[int], list[int]]:
    """(shape, strides) of a pool ``[N, PAGE, Hkv, D]`` as rows a token's stride long
    (``hopper_refusal`` checks that the pool allows it): ``[N * PAGE, Hkv * D]``, a token's
    row of heads per row, or for pools that keep a head's rows of a page together
    (``kv_quant.is_head_major``) ``[N * Hkv * PAGE, D]``. The Hopper path's and the Gluon
    kernel's descriptors both take this view (Gluon: token rows only, ``gluon_refusal``)."""
    n, page, hkv, d = pool.shape
    if is_head_major(pool):
        return [n * hkv * page, d], [d, 1]
    return [n * page, hkv * d], [pool.stride(1), 1]


def _kv_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> list:
    """The pools as ``pool_view`` for bulk copies of ``[block_n, D]`` tiles."""
    d = k_cache.shape[3]
    return [TensorDescriptor(x, *pool_view(x), [block_n, d]) for x in (k_cache, v_cache)]


def _scale_descriptors(k_scale: torch.Tensor, v_scale: torch.Tensor, block_n: int) -> list:
    """The scale pools (contiguous ``[N, Hkv, PAGE]``) as one run each, for bulk copies of a
    tile's ``block_n`` scales."""
    return [TensorDescriptor(x, [x.numel()], [1], [block_n]) for x in (k_scale, v_scale)]


def _gluon_config(q, k_cache, v_cache, fp8: bool, window: int, softcap: float, config):
    """The Gluon kernel's module and config for ``path="gluon"``; ValueError with the reason
    if it cannot take these inputs (its own refusals, then the Hopper path's pool and
    descriptor checks, which it shares). The module is imported only here: Gluon's API moves
    between Triton versions, and the other paths must not depend on it."""
    from kernels import prefill_gluon as pg

    if config is not None and not isinstance(config, pg.GluonConfig):
        raise ValueError(f'path="gluon" takes a GluonConfig as config, got {config!r}')
    if config is None and k_cache.shape[1] < 16:  # before gluon_config's own ValueError
        raise ValueError(f"prefill: the Gluon path cannot run this: page {k_cache.shape[1]} "
                         "< 16, the smallest KV tile")  # fmt: skip
    cfg = config or pg.gluon_config(q.shape[2], q.dtype, k_cache.shape[1])
    cap = torch.cuda.get_device_capability(q.device) if q.is_cuda else None
    why = pg.gluon_refusal(q, k_cache, window, softcap, fp8, cfg, cap) or hopper_refusal(
        q, k_cache, v_cache, cfg.block_n
    )
    if why:
        raise ValueError(f"prefill: the Gluon path cannot run this: {why}")
    return pg, cfg


def _auto_gluon(q, k_cache, v_cache, fp8: bool, window: int, softcap: float, config):
    """What ``path="auto"`` runs the Gluon kernel with (``_gluon_config``'s module and config),
    or None for the other paths: it takes it with no config given, on sm_90 itself under
    Triton 3.6, with pages of >= HOPPER_MIN_PAGE tokens and inputs the kernel takes (H100,
    2026-11-27: 558 / 589 TFLOP/s at 4K / 16K with 128-token pages, the Hopper path 480 /
    512; docs/benchmarks/kernels.md)."""
    if config is not None or not q.is_cuda or k_cache.shape[1] < HOPPER_MIN_PAGE:
        return None
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return None
    if gluon_triton_refusal(triton.__version__) is not None:
        return None
    try:
        return _gluon_config(q, k_cache, v_cache, fp8, window, softcap, None)
    except ValueError:  # windows, soft-caps, fp8, fp32, pools its descriptors cannot take
        return None


def _auto_gluon_fp8(q, k_cache, window: int, softcap: float, config, scratch, pages: int):
    """What ``path="auto"`` over an fp8 cache runs the Gluon kernel with on the 16-bit
    ``scratch`` pools (``kernels.kv_dequant``), or None (the Hopper or portable path over the
    fp8 cache): as ``_auto_gluon`` for a 16-bit cache of the scratch's pages, when a sequence
    of ``pages`` pages fits in it (a batch that does not fit whole runs in groups that do)."""
    if scratch is None or config is not None or window or softcap:
        return None
    k16, v16 = scratch
    if k16.dtype != q.dtype or k16.shape[1:] != k_cache.shape[1:] or pages > k16.shape[0]:
        return None
    return _auto_gluon(q, k16, v16, False, 0, 0.0, None)


def _gluon_over_fp8(module, cfg, q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q,
                    seq_lens, block_tables, scale, max_query_len, out, lse, scratch,
                    pages: int) -> None:  # fmt: skip
    """The Gluon kernel over an fp8 cache: each group of sequences whose ``pages`` pages each
    fit in ``scratch`` together, dequantized into it (``kernels.kv_dequant``), then read from
    there. A group's slices of ``cu_seqlens_q`` address ``q``, ``out`` and ``lse`` whole (the
    offsets are absolute): no host sync. The groups run in turn on the stream, each one's
    dequantization after the kernel before it has read the scratch."""
    bsz = seq_lens.shape[0]
    group = min(bsz, scratch[0].shape[0] // pages)
    tables = scratch_tables(group, pages, q.device)
    for lo in range(0, bsz, group):
        hi = min(lo + group, bsz)
        dequantize_pages(k_cache, v_cache, k_scale, v_scale, block_tables[lo:hi],
                         seq_lens[lo:hi], pages, *scratch)  # fmt: skip
        module.gluon_prefill(q, *scratch, cu_seqlens_q[lo : hi + 1], seq_lens[lo:hi],
                             tables[: hi - lo], scale, max_query_len, out, lse, cfg)  # fmt: skip


def _pick_path(path: str, q, k_cache, v_cache, fp8: bool, config) -> tuple[bool, tuple]:
    """(whether the Hopper path runs, the 5-entry config; programs_per_sm 0 on the portable
    path): ``"auto"`` takes the Hopper path on sm_90 with pages of >= HOPPER_MIN_PAGE tokens
    when the inputs allow it; ``"hopper"`` raises ValueError if they do not."""
    if not isinstance(config, (tuple, list, type(None))):
        raise ValueError(f'config {config!r} is for path="gluon"; this path takes a tuple')
    d, page = q.shape[2], k_cache.shape[1]
    if path != "portable":
        cfg = tuple(config) if config else hopper_config(d, q.dtype, page, fp8)
        cfg = cfg if len(cfg) == 5 else (*cfg, 1)
        why = hopper_refusal(q, k_cache, v_cache, cfg[1])
        if path == "hopper":
            if why:
                raise ValueError(f"prefill: the Hopper path cannot run this: {why}")
            return True, cfg
        on_hopper = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9
        if on_hopper and page >= HOPPER_MIN_PAGE and why is None:
            return True, cfg
    cfg = tuple(config) if config else prefill_config(d, q.dtype)
    return False, (*cfg[:4], 0)


def prefill_attention(
    q: torch.Tensor,  # [T, Hq, D], the sequences' query chunks back to back
    k_cache: torch.Tensor,  # [N, BS, Hkv, D]
    v_cache: torch.Tensor,  # [N, BS, Hkv, D]
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, KV length including this chunk
    block_tables: torch.Tensor,  # [B, M] int32
    scale: float,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    *,
    config: tuple[int, ...] | GluonConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    path: str = "portable",
    fp8_scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_splits: int = 1,
):
    """Causal attention of each chunk over its cached context plus itself (see module doc).

    ``max_query_len`` (host int) sizes the grid; if None it is read from ``cu_seqlens_q`` (a
    device sync). ``max_seq_len`` (host int, >= every ``seq_lens[b]``; None: the block
    table's width) bounds the pages ``fp8_scratch`` must hold. ``config`` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages[, programs_per_sm]) overrides the tuning; the
    fifth entry is the Hopper path's persistent programs per SM (default 1; 0: no persistent
    loop, one program per work item). ``path``: ``"portable"`` (the default: every GPU and the
    interpreter), ``"auto"`` (on sm_90 with pages of >= 64 tokens: the Gluon kernel where it
    can run, ``_auto_gluon``, else the Hopper path when the inputs allow it; else the portable
    one), ``"hopper"`` (ValueError if the inputs do not allow it: ``hopper_refusal``), or
    ``"gluon"`` (``kernels.prefill_gluon``, FlashAttention-3 style, sm_90 only; ``config`` is
    then a ``GluonConfig``; ValueError with the reason if the inputs do not fit it: windows,
    soft-capping, fp8 and fp32 are refused). ``window`` >
    0: a query at position p sees keys ``p - window < j <= p`` only, and the pages left of its
    window are not read; ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``
    (0: off). An fp8 cache (``float8_e4m3fn`` pages) comes with its scale pools
    ``k_scale``/``v_scale`` ``[N, Hkv, BS]`` (``kernels.kv_quant``). ``fp8_scratch``: two
    16-bit pools ``[S, BS, Hkv, D]`` of q's dtype; with ``path="auto"`` over an fp8 cache,
    where the Gluon kernel would take a 16-bit cache and a sequence's pages fit in them, the
    pages are dequantized into them (``kernels.kv_dequant``; the batch in groups that fit:
    ``_gluon_over_fp8``) and the Gluon kernel reads those.
    ``kv_splits`` > 1 (the portable path, no window): each query tile's keys before its
    diagonal are cut into that many parts, each a program of its own (grid ``(tiles, Hq, B *
    kv_splits)``), merged by their LSEs after (``merge_kv_parts``): for a few query tiles over a
    long context, whose programs alone would leave most SMs idle. ``"auto"`` on a GPU takes
    that where ``prefill_kv_splits`` cuts (host ``max_query_len`` and ``max_seq_len`` given,
    no window).
    Returns ``out`` [T, Hq, D], and ``lse`` [T, Hq] fp32 (natural log) if ``return_lse``.
    """
    window, softcap = check_window_softcap(window, softcap)
    t, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if q.dim() != 3 or d != dk or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    if q.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("the head dim of q and the caches must be contiguous")
    if page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")
    for name, x in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens),
                    ("block_tables", block_tables)):  # fmt: skip
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    bsz = seq_lens.shape[0]
    if cu_seqlens_q.shape != (bsz + 1,) or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("cu_seqlens_q must be [B+1], block_tables [B, M] with contiguous rows")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous head dim")
    lse = torch.empty((t, hq), dtype=torch.float32, device=q.device) if return_lse else None
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if kv_splits < 1 or (kv_splits > 1 and (path != "portable" or window > 0)):
        raise ValueError(f"kv_splits {kv_splits}: >= 1, and > 1 only on the portable path "
                         "without a window")  # fmt: skip
    if (
        path == "auto"
        and kv_splits == 1
        and window == 0
        and q.is_cuda
        and (max_query_len is not None and max_seq_len is not None)
    ):  # a few query tiles over a long context: the portable kernel over parts of the keys
        block_m, block_n = prefill_config(d, q.dtype)[:2]
        tiles = triton.cdiv(max_query_len, block_m) * hq * bsz
        kv_splits = prefill_kv_splits(tiles, max_seq_len, block_n, num_sms(q.device))
        path = "portable" if kv_splits > 1 else path
    gluon = dequant = None
    if path == "gluon":  # refused before the empty-batch return: the answer must not depend on T
        gluon = _gluon_config(q, k_cache, v_cache, fp8, window, softcap, config)
    elif path == "auto" and fp8:
        pages = block_tables.shape[1] if max_seq_len is None else triton.cdiv(max_seq_len, page)
        pages = min(pages, block_tables.shape[1])
        gluon = _auto_gluon_fp8(q, k_cache, window, softcap, config, fp8_scratch, pages)
        dequant = pages if gluon is not None else None
    elif path == "auto":
        gluon = _auto_gluon(q, k_cache, v_cache, fp8, window, softcap, config)
    if t == 0 or bsz == 0:
        return (out, lse) if return_lse else out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    if gluon is not None:
        module, gluon_cfg = gluon
        if dequant is not None:  # the fp8 pages into the 16-bit scratch, read from there
            _gluon_over_fp8(module, gluon_cfg, q, k_cache, v_cache, k_scale, v_scale,
                            cu_seqlens_q, seq_lens, block_tables, scale, max_query_len, out,
                            lse, fp8_scratch, dequant)  # fmt: skip
        else:
            module.gluon_prefill(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables,
                                 scale, max_query_len, out, lse, gluon_cfg)  # fmt: skip
        return (out, lse) if return_lse else out

    hopper, (block_m, block_n, num_warps, num_stages, per_sm) = _pick_path(
        path, q, k_cache, v_cache, fp8, config
    )
    lse_arg = lse if return_lse else out
    n_tiles = triton.cdiv(max_query_len, block_m)
    kv = _kv_descriptors(k_cache, v_cache, block_n) if hopper else (k_cache, v_cache)
    if not fp8:
        scales = (k_cache, v_cache)  # unread
    elif hopper and block_n >= SCALE_TMA_MIN_N:
        scales = _scale_descriptors(k_scale, v_scale, block_n)
    else:
        scales = (k_scale, v_scale)
    split = kv_splits > 1
    if per_sm:  # persistent: a program per SM slot, looping over the work items
        grid = (min(n_tiles * hq * bsz, num_sms(q.device) * per_sm),)
    else:
        grid = (n_tiles, hq, bsz * kv_splits)
    if split:  # the parts' outputs and LSEs, merged below
        parts = torch.empty((kv_splits, t, hq, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((kv_splits, t, hq), dtype=torch.float32, device=q.device)
        dest, dest_lse = parts[0], part_lse[0]
    else:
        dest, dest_lse = out, lse_arg
    _prefill_kernel[grid](
        q, *kv, *scales, cu_seqlens_q, seq_lens, block_tables, dest, dest_lse,
        scale * _LOG2E, *softcap_factors(scale, softcap), window, n_tiles, hq, bsz,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if fp8 else 0,
        block_tables.stride(0),
        dest.stride(0), dest.stride(1),
        *((dest_lse.stride(0), dest_lse.stride(1)) if split or return_lse else (0, 0)),
        kv_splits, parts.stride(0) if split else 0, part_lse.stride(0) if split else 0,
        GROUP=hq // hkv, HEAD_DIM=d, PAGE=page, STORE_LSE=return_lse,
        WINDOWED=window > 0, SOFTCAP=softcap > 0, FP8=fp8, TMA=hopper,
        HEAD_MAJOR=hopper and is_head_major(k_cache), PERSISTENT=per_sm > 0, SPLIT=split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        merge_kv_parts(parts, part_lse, out, lse)
    return (out, lse) if return_lse else out


def merge_kv_parts(
    parts: torch.Tensor,  # [S, T, Hq, D] fp32, each part's normalized output
    part_lse: torch.Tensor,  # [S, T, Hq] fp32, each part's LSE (-inf: an empty part)
    out: torch.Tensor,  # [T, Hq, D]
    lse: torch.Tensor | None = None,  # [T, Hq] fp32
) -> None:
    """``out = sum_s exp(lse_s - lse) parts_s`` with ``lse = log sum_s exp(lse_s)`` (every row
    has a part with keys: the last holds the diagonal)."""
    total = torch.logsumexp(part_lse, dim=0)  # [T, Hq]
    weights = torch.exp(part_lse - total)  # [S, T, Hq]; 0 for an empty part
    out.copy_(torch.einsum("sth,sthd->thd", weights, parts))
    if lse is not None:
        lse.copy_(total)


def prefill_kv_splits(n_programs: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Parts to cut each query tile's keys into (``prefill_attention(kv_splits=)``) where the
    step's own programs (query tiles x heads x sequences) would leave half the SMs or more
    idle: about one wave of programs (the portable kernel's 128 x 128 tiles take one program
    an SM at head dim 128), each part at least 8 KV tiles long; else 1 (no cut). A 128-token
    chunk of 32 heads over 120K tokens (H100, ``docs/benchmarks/serving.md``, session 36): one
    program per head walks all of it, 1.36 ms a layer on the Gluon path and 2.42 on the
    portable one; in 4 parts 0.74 (2 parts 1.37, 8 parts 0.76); over an fp8 cache 0.98 against
    3.34 on the Hopper path. A 512-token chunk (128 programs) is not cut: in parts it lost (2.65
    ms against 1.67 on Gluon)."""
    if 2 * n_programs > sms:
        return 1
    return max(1, min(sms // n_programs, max_seq_len // (8 * block_n), 32))
