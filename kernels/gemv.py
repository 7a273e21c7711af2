"""Linear layers at decode-time batch sizes (Triton): ``out = x @ weight.T + bias``, 1 <= M <= 16.

At M <= 16 a linear layer is a matrix-vector product bound by reading the weight once, so the
kernel is built to stream ``weight`` at the copy bandwidth::

    out[m, n] = sum_k x[m, k] * weight[n, k] + bias[n]      x [M, K], weight [N, K], out [M, N]

One kernel (``_linear_kernel``), grid ``(cdiv(N, BLOCK_N), S)``: program ``(j, s)`` owns output
columns ``n`` of tile ``j`` (BLOCK_N weight rows) and walks K-split ``s`` of the reduction in
BLOCK_K steps with fp32 accumulators, keeping ``num_stages`` weight tiles in flight. M = 1
multiplies elementwise into a [BLOCK_N, BLOCK_K] accumulator that is summed once at the end;
M > 1 pads M to 16 and uses ``tl.dot`` (``_dot_steps``; the padded rows re-read row M - 1, a
cache hit, and are never stored). With ``S == 1`` the program writes the output. With
``S > 1`` (N too small to give every SM enough programs) each program stores its fp32
partial [M, BLOCK_N] and the last of the ``S`` programs of a tile to finish (an atomic counter
per tile tells it) sums the partials in split order, adds the bias and writes the output: one
launch, and the same result whichever program finishes last.

Float8 weights (``weight_scale`` given, ``kernels.quant``'s layouts) stream half the bytes and
take ``tl.dot`` at every M, M = 1 included: an e4m3 pair widens to an f16 pair in one
instruction, and the tensor cores multiply and sum in fp32, where widening to fp32 for FMAs
cost three instructions per element. x is loaded once per step for its M rows (rounded up to a
power of two, repeated to the dot's 16) and rounded to f16 (exact for bf16 in f16's range;
rows outside it are scaled by a power of two and the steps run again: ``_dot_steps``'s caller);
fp32 x keeps fp32 operands (``ieee``). Per-channel scales multiply the fp32 sums once, as they
are stored (``out[m, n] = scale[n] * sum_k x[m, k] * q[n, k]``); block scales vary along K, so
a K step runs in parts of 128 columns (one block; the whole step if BLOCK_K <= 128), each part's
product multiplied by its block's scale before it is added (BLOCK_N divides 128: a tile's rows
share their block row). A bf16/fp16/fp32 weight (``W_SCALE`` 0) compiles to the same loops as
before fp8 existed. At M <= 8, ``diag`` (any weight) gives the dot 8 columns, x's rows in
8 / M chunks each, instead of x repeated to 16, the weight tile viewed as 8 / M times the rows,
and keeps the diagonal blocks: half the MMAs; fp8 at M = 1 half the SASS per byte
(``_dot_steps``; bf16 M = 8 0.42 against 0.90, M = 1 against the elementwise loop's 1.97).
``gemv_config`` picks it where it measured faster: fp8 per channel at M = 1 on 16-row one-warp
tiles, bf16 at M = 2-8.

Gated MLPs (``GATED``, ``linear_small_m(act=...)``): the weight is the fused ``[gate; up]``
projection ``[2I, K]`` and the kernel writes ``act(x @ gate.T) * (x @ up.T)`` ``[M, I]``,
saving the activation kernel's launch (and the [M, 2I] round trip). A tile's BLOCK_N rows are
BLOCK_N / 2 gate rows interleaved with the up rows of the same output columns (tile column
``2j`` gate row ``i``, ``2j + 1`` up row ``I + i``), so the K loop is the ungated one, over
other row addresses; at the end ``tl.split`` pairs the columns and the activation (SiLU or
GELU-tanh, ``kernels.activation.gate_act``) runs on the fp32 sums, after the split sum and
the scales. Block scales: the tile's gate rows read one block row's scale, its up rows
another's (so I must be a multiple of BLOCK_N / 2; ``linear_act_and_mul`` leaves other I to the
unfused path). sm_90 compile reports (``tests/sm90_compile.py gemv``): the K loop's SASS per
weight byte is the ungated tile's within 2%, block scales 3.3% (bf16 M = 1 1.969 both; fp8
block mma.sync 1.621 against 1.594). H200, graph replay, M = 1, gate_up fused against GEMV
then activation kernel (``python -m kernels.bench_gemv --gated``), us: Gemma-3-12B bf16
54.9 / 56.9, Llama-3-8B 54.4 / 55.5, Qwen3-8B 47.3 / 48.4; fused within 0.2 us of the GEMV.

Tensor parallelism on two ranks (``FOLD``, ``linear_small_m(fold=...)``): a row-parallel layer's
output is also stored into the other rank's symmetric-memory slot of this call, each value
in an 8-byte word with the call's tag (``kernels.fold``), where the norm after it waits for
them: the all-reduce without a collective, a fence or a flag. The K loop is untouched (sm_90
compile reports: the same SASS per weight byte within 1%, tests/test_tp_fold_compile.py).

The RMSNorm between two projections (``residual=``, ``norm=``; ``linear_add``, ``linear(norm=)``):
the first projection's epilogue adds its output to the residual stream and stores each tile's
sum of the sum's squares by row (``[M, tiles]``); the second multiplies x by the norm's weight
as it loads it and its sums by each row's 1 / rms, from those partial sums (loaded before its
K loop, summed after it in one order in every program). So the norm's kernel and its round
trip go. ``fuses_norms`` says where it pays (16-bit and float8 weights; measured there;
float8 producers with ptxas's register cap, ``max_regs_for``).

CUDA graphs: the grid depends only on the shapes; the partials come from ``torch.empty``; the
counters live in a per-device buffer that every launch leaves zeroed (the summing program resets
its own), so replays need no memset. Calls on one device must not overlap in time (one stream).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.activation import gate_act, gelu_tanh_and_mul, silu_and_mul
from kernels.common import SplitCounters, measured_for, measured_on, pdl_enter, pdl_kwargs
from kernels.common import num_sms as _num_sms
from kernels.fold import AllReduceFold, fold_call, fold_send
from kernels.fp8 import fp8_linear
from kernels.norm import rms_norm
from kernels.reference import RowNorm

MAX_M = 16
# _linear_kernel's GATED: the activation of a gated MLP's fused gate/up projection, by the
# name ``ModelConfig.hidden_act`` gives it
GATED_ACTS = {"silu": 1, "gelu_tanh": 2}
_GATED_GELU_TANH = tl.constexpr(GATED_ACTS["gelu_tanh"])  # a jit function reads constexprs


@triton.jit
def _store_out(acc, Bias, Scale, Out, Send, tag, offs_m, offs_n, n_mask, col0, M, n_out,
               stride_om, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr, GATED: tl.constexpr,
               LIBDEVICE: tl.constexpr, FOLD: tl.constexpr, Res=None, stride_rm=0, SumSq=None,
               tile=0, stride_sq=0, ADD_RES: tl.constexpr = False):  # fmt: skip
    """acc [BM, BN] fp32, column j the sum of weight row ``offs_n[j]`` (valid where
    ``n_mask``): ``y = acc (* scale[row]) (+ bias[row])``, then out[m, col0 + j] = y[m, j]
    (GATED 0), or with GATED the act of each even column times the odd one after it,
    ``act(y[m, 2j]) * y[m, 2j + 1]`` (SiLU: 1, GELU-tanh: 2), in fp32; for m < M and output
    columns < n_out. FOLD: the same values into ``Send`` too, as words tagged ``tag`` (the
    peer's slot, rows of n_out: ``kernels.fold``). ADD_RES: y rounded to out's dtype, then
    ``out = res + y`` rounded again (the residual add), and the tile's sum of ``out[m]**2``
    over its columns, float32, stored at ``SumSq + tile + m * stride_sq``."""
    if ROW_SCALE:
        acc *= tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:  # [BM, BN] -> [BM, BN/2]: the gate and up sums of one output column side by side
        gate, up = tl.split(tl.reshape(acc, [acc.shape[0], acc.shape[1] // 2, 2]))
        acc = gate_act(gate, GATED == _GATED_GELU_TANH, LIBDEVICE) * up
    offs_o = col0 + tl.arange(0, acc.shape[1])
    ptrs = Out + offs_m[:, None] * stride_om + offs_o[None, :]
    mask = (offs_m < M)[:, None] & (offs_o < n_out)[None, :]
    y = acc.to(Out.dtype.element_ty)
    if ADD_RES:  # as kernels.reference.add_rms_norm adds: both rounded, summed, rounded
        r = tl.load(Res + offs_m[:, None] * stride_rm + offs_o[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(Out.dtype.element_ty)
        yf = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(SumSq + tile + offs_m * stride_sq, tl.sum(yf * yf, 1), mask=offs_m < M)
    tl.store(ptrs, y, mask=mask)
    if FOLD:
        fold_send(Send + offs_m[:, None] * n_out + offs_o[None, :], y, mask, tag)


@triton.jit
def _rows(x, ROWS: tl.constexpr):
    """x [R, C] repeated to ROWS rows (R divides ROWS): row r of the result is x's r % R."""
    if x.shape[0] == ROWS:
        return x
    if x.shape[0] == 1:
        return tl.broadcast_to(x, [ROWS, x.shape[1]])
    return tl.reshape(tl.broadcast_to(x[None, :, :], [ROWS // x.shape[0], x.shape[0], x.shape[1]]),
                      [ROWS, x.shape[1]])  # fmt: skip


@triton.jit
def _norm_sums(NormSq, M, n_parts, ROWS: tl.constexpr, NORM_PARTS: tl.constexpr):
    """The partial sums of squares of x's rows ``min(m, M - 1)``, m < ROWS (``NormSq`` [M,
    n_parts], a producing GEMV's tiles: ``_store_out``'s ADD_RES), [ROWS, NORM_PARTS] float32,
    zeros past n_parts: loaded before the K loop, summed after it (``_rms_scale``)."""
    rows = tl.minimum(tl.arange(0, ROWS), M - 1)
    offs = tl.arange(0, NORM_PARTS)
    return tl.load(NormSq + rows[:, None] * n_parts + offs[None, :],
                   mask=(offs < n_parts)[None, :], other=0.0)  # fmt: skip


@triton.jit
def _rms_scale(sums, K, eps, BLOCK_M: tl.constexpr):
    """``1 / sqrt(mean(x[m]**2) + eps)`` [BLOCK_M, 1] from ``_norm_sums``'s parts (x's rows,
    repeated to BLOCK_M as the dot repeats them), summed in one order in every program."""
    return _rows(tl.math.rsqrt(tl.sum(sums, 1) / K + eps)[:, None], BLOCK_M)


# DIAG: the dot 8 columns wide (mma.sync's narrowest N): x's M rows (a power of two <= 8) of 8 / M
# chunks each. sm_90 compile reports (tests/sm90_compile.py), SASS per weight byte of the K loop
# at M = 1, fp8 per channel, against x repeated to 16 columns: (16, 256, 1 warp) 1.41 / 2.89,
# (32, 128, 1 warp, split) 1.21 / 2.08.
_DIAG_COLS = tl.constexpr(8)


@triton.jit
def _dot_steps(w_ptrs, x_ptrs, offs_x, s_ptr, s_up_ptr, is_up, x_scale, k_lo, k_hi, offs_k,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               NUM_STAGES: tl.constexpr, EVEN_K: tl.constexpr, W_SCALE: tl.constexpr,
               F16_DOT: tl.constexpr, SCALE_X: tl.constexpr, TRACK_X: tl.constexpr,
               DOT_PRECISION: tl.constexpr, DIAG: tl.constexpr, nw_ptrs=None,
               NORM_X: tl.constexpr = False):  # fmt: skip
    """The reduction over K steps ``[k_lo, k_hi)`` with ``tl.dot``: ``acc[n, m] = sum_k w[n, k]
    * x[m, k]`` [BLOCK_N, BLOCK_M] fp32, x's rows repeated to BLOCK_M (``_rows``). A step loads
    BLOCK_K columns in parts as wide as the pointers ``w_ptrs`` [BN, PK] and ``x_ptrs`` [XM, PK]
    (BLOCK_K, or 128 with block scales: W_SCALE 2 multiplies each part's product by its block's
    scale, read at ``s_ptr``, or at ``s_up_ptr`` for the rows where ``is_up`` [BN, 1] (gated
    tiles; None: all rows at ``s_ptr``)). F16_DOT: both operands in f16 (an e4m3 pair widens to
    f16 in one instruction; bf16 x rounds exactly in f16's range), SCALE_X: x's rows times
    ``x_scale`` [XM] first, TRACK_X (bf16 x): also return ``max_k |x[m, k]|`` per loaded row
    (else zeros), kept as bf16 bits (their order is the values'; 2-byte registers where float32
    took 4). ``offs_x``: x's columns within a part, the shape of ``x_ptrs`` (its K mask).
    NORM_X: x times the norm's weight (``nw_ptrs``, x_ptrs' shape) as it is loaded, rounded to
    x's dtype, before anything else touches it (the rows' 1 / rms is the caller's, after).

    DIAG (x's rows a power of two BLOCK_M <= 8, no repeats): each row's part is read as G =
    8 / BLOCK_M chunks, ``x_ptrs`` [PK / G, 8] (column ``m G + g``: chunk g of row m), and the
    weight part [BN, PK] as [G BN, PK / G] (row ``G n + c``: chunk c of row n), so one dot gives
    ``acc[G n + c, m G + g] = sum_k w[n, chunk c][k] x[m, chunk g][k]``, and ``out[n, m] =
    sum_g acc[G n + g, m G + g]`` at the end. The dot is 8 columns wide where x repeated to 16
    made 16, and x is converted once a chunk; ``is_up`` is [G BN, 1] then."""
    PART_K: tl.constexpr = w_ptrs.shape[1]
    G: tl.constexpr = _DIAG_COLS // BLOCK_M  # DIAG: chunks a row
    if DIAG:
        acc = tl.zeros([BLOCK_N * G, _DIAG_COLS], tl.float32)
        if SCALE_X:  # x_scale [BM] over the columns m G + g
            x_scale = tl.reshape(tl.broadcast_to(x_scale[:, None], [BLOCK_M, G]), [_DIAG_COLS])
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    amax = tl.zeros(x_ptrs.shape, tl.int16)  # [XM, PK] ([PK / G, 8] with DIAG)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        for part in tl.static_range(0, BLOCK_K, PART_K):
            if EVEN_K:
                w = tl.load(w_ptrs + part, eviction_policy="evict_first")
                x = tl.load(x_ptrs + part, eviction_policy="evict_last")
                if NORM_X:
                    nw = tl.load(nw_ptrs + part, eviction_policy="evict_last")
            else:
                k_mask = (k0 + part + offs_k) < k_hi
                w = tl.load(w_ptrs + part, mask=k_mask[None, :], other=0.0,
                            eviction_policy="evict_first")  # fmt: skip
                x = tl.load(x_ptrs + part, mask=(k0 + part + offs_x) < k_hi, other=0.0,
                            eviction_policy="evict_last")  # fmt: skip
                if NORM_X:
                    nw = tl.load(nw_ptrs + part, mask=(k0 + part + offs_x) < k_hi, other=0.0,
                                 eviction_policy="evict_last")  # fmt: skip
            if NORM_X:
                x = x * nw
            if TRACK_X:
                amax = tl.maximum(amax, x.to(tl.int16, bitcast=True) & 0x7FFF)
            if SCALE_X and DIAG:
                x = x.to(tl.float32) * x_scale[None, :]
            elif SCALE_X:
                x = x.to(tl.float32) * x_scale[:, None]
            if F16_DOT:
                x = x.to(tl.float16)
            w = w.to(x.dtype)  # a float8 weight widens exactly
            if DIAG:
                w = tl.reshape(w, [BLOCK_N * G, PART_K // G])
                xt = x  # [PK / G, 8]
            else:
                xt = tl.trans(_rows(x, BLOCK_M))  # [PK, BM]
            if W_SCALE == 2:  # with is_up [BN, 1] (gated), those rows' scale from s_up_ptr
                if EVEN_K:
                    kb = (k0 + part) // 128
                else:  # a part wholly past K (K % 256 in 1..128) has no block: the last one's
                    kb = tl.minimum(k0 + part, k_hi - 1) // 128  # (times 0)
                s = tl.load(s_ptr + kb)
                if is_up is not None:
                    s = tl.where(is_up, tl.load(s_up_ptr + kb), s)
                acc += tl.dot(w, xt, input_precision=DOT_PRECISION) * s
            else:
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        if NORM_X:
            nw_ptrs += BLOCK_K
    if DIAG:  # out[n, m] = sum_g acc[G n + g, m G + g]; amax [PK / G, 8] -> [BM, PK / G * G]
        acc = tl.reshape(acc, [BLOCK_N, G, BLOCK_M, G])
        eye = tl.arange(0, G)[:, None] == tl.arange(0, G)[None, :]  # [G, G]
        acc = tl.sum(tl.sum(tl.where(eye[None, :, None, :], acc, 0.0), 3), 1)  # [BN, BM]
        amax = tl.reshape(tl.trans(amax), [BLOCK_M, G * (PART_K // G)])
    return acc, tl.max(amax, 1).to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)


# bf16 x in f16 (F16_DOT): exact for |x| <= 65504 (larger is inf); an element under 2^-14 rounds
# to a multiple of 2^-24, under 2^-15 of a row's largest while that is >= 2^-10 (bf16's own step
# is 2^-8 of a value). A row outside those bounds is scaled by a power of two into [2^14, 2^15).
_F16_MAX = tl.constexpr(65504.0)
_X_SMALL = tl.constexpr(2.0**-10)


@triton.jit
def _linear_kernel(
    X,  # [M, K]
    W,  # [N, K] contiguous: x's dtype, or float8 e4m3 (W_SCALE > 0)
    Bias,  # [N] (HAS_BIAS)
    Scale,  # fp32: [N] (W_SCALE 1) or [cdiv(N, 128), cdiv(K, 128)] (W_SCALE 2)
    Out,  # [M, N]
    Part,  # [S, M, N] fp32 partial sums (SPLIT)
    Counters,  # [cdiv(N, BLOCK_N)] int32, zero between launches (SPLIT)
    M,
    N,
    K,
    num_splits,  # S
    k_split,  # K elements per split, a multiple of BLOCK_K
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,  # S > 1
    USE_DOT: tl.constexpr,  # tl.dot with M padded to BLOCK_M = 16 (M > 1, or a float8 weight)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask along K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    MERGE_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CHAIN: tl.constexpr,
    W_SCALE: tl.constexpr = 0,  # 0: none; 1: one per row (at the end); 2: 128x128 blocks
    X_ROWS: tl.constexpr = 16,  # x rows loaded per step (a power of two >= M), repeated to 16
    F16_DOT: tl.constexpr = False,  # a float8 weight and 16-bit x: f16 operands
    DIAG: tl.constexpr = False,  # M <= 8 on tl.dot: x's rows in chunks (``_dot_steps``)
    GATED: tl.constexpr = 0,  # 0: out = the product; SiLU (1), GELU-tanh (2): the gated MLP's
    LIBDEVICE: tl.constexpr = False,  # GELU's tanh from libdevice (CUDA), else made of exp
    Send=None,  # [2, R, N] int64 words, the peer's slots (FOLD: kernels.fold)
    Calls=None,  # [1] int64, this rank's folded calls (FOLD)
    stride_send=0,  # words of one slot of Send (FOLD)
    FOLD: tl.constexpr = False,  # the output to the peer's slot too, as tagged words
    Res=None,  # [M, N] the residual stream (ADD_RES)
    SumSq=None,  # [M, cdiv(N, BLOCK_N)] float32: each tile's sum of out**2 by row (ADD_RES)
    stride_rm=0,
    ADD_RES: tl.constexpr = False,  # out = res + the product, and its sums of squares
    NormSq=None,  # [M, P] float32: P partial sums of squares of each x row (NORM_X)
    NormW=None,  # [K] the norm's weight (NORM_X)
    norm_parts=0,  # P
    norm_eps=0.0,
    NORM_PARTS: tl.constexpr = 1,  # P rounded up to a power of two
    NORM_X: tl.constexpr = False,  # x's rows RMSNormed as they are loaded
):
    pdl_enter(CHAIN)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    tag = 0
    if FOLD:  # this call's slot of the peer's buffer, its words' tag
        slot, tag = fold_call(Calls)
        Send += slot * stride_send
    offs_m = tl.arange(0, BLOCK_M)
    if GATED:  # W is [gate; up], N = 2I rows: tile column c is gate row i (c even) or up row
        half = N // 2  # I + i (c odd), i = pid_n * BLOCK_N / 2 + c // 2, an output column
        offs_c = tl.arange(0, BLOCK_N)
        offs_i = pid_n * (BLOCK_N // 2) + offs_c // 2
        up_row = (offs_c % 2) * half
        offs_n = offs_i + up_row  # [BN] the weight rows
        n_mask = offs_i < half
        w_rows = (tl.minimum(offs_i, half - 1) + up_row).to(tl.int64)
        col0 = pid_n * (BLOCK_N // 2)
        n_out = half
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        col0 = pid_n * BLOCK_N
        n_out = N
    # block scales change every 128 columns: on tl.dot a wider K step loads 128-column parts
    PART_K: tl.constexpr = 128 if USE_DOT and W_SCALE == 2 and BLOCK_K > 128 else BLOCK_K
    offs_k = tl.arange(0, PART_K)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    # Out-of-range rows are clamped, not masked: every weight load is a full, unmasked tile.
    w_ptrs = W + w_rows[:, None] * K + (k_lo + offs_k)[None, :]  # [BN, PK]
    G: tl.constexpr = _DIAG_COLS // BLOCK_M  # DIAG: chunks of each x row
    if USE_DOT and DIAG:  # chunk g of x's row m in column m G + g: [PK / G, 8]
        cols = tl.arange(0, _DIAG_COLS)
        offs_x = (cols % G * (PART_K // G))[None, :] + tl.arange(0, PART_K // G)[:, None]
        x_rows = tl.minimum(cols // G, M - 1)  # rows past M re-read row M - 1
        x_ptrs = X + x_rows[None, :] * stride_xm + (k_lo + offs_x)
    elif USE_DOT:
        x_rows = tl.minimum(tl.arange(0, X_ROWS), M - 1)  # rows past M re-read row M - 1
        offs_x = offs_k[None, :]
        x_ptrs = X + x_rows[:, None] * stride_xm + (k_lo + offs_k)[None, :]  # [XM, PK]
    else:  # M = 1, elementwise
        x_rows = tl.zeros([1], tl.int32)
        offs_x = offs_k[None, :]
    nw_ptrs = None
    if NORM_X:  # the norm's weight beside x; the rows' sums of squares in flight over the loop
        nw_ptrs = NormW + (k_lo + offs_x)
        # x's rows once each (the dot's 16 columns repeat X_ROWS of them; diag: BLOCK_M)
        NORM_ROWS: tl.constexpr = X_ROWS if USE_DOT and not DIAG else BLOCK_M
        norm_sums = _norm_sums(NormSq, M, norm_parts, NORM_ROWS, NORM_PARTS)  # [NR, NP]
    if USE_DOT:
        # BLOCK_N divides 128 (block scales): the tile's rows share one row of scale blocks;
        # gated, its gate rows one and its up rows another (I a multiple of BLOCK_N / 2; one
        # pointer per row instead: +0.7-0.9 us on the scales' loads, H200, Qwen3-8B gate_up)
        if GATED:
            s_ptr = Scale + col0 // 128 * tl.cdiv(K, 128)
            s_up_ptr = Scale + (half + col0) // 128 * tl.cdiv(K, 128)
            if DIAG:  # the dot's rows: chunk c of tile column j at G j + c
                is_up = ((tl.arange(0, BLOCK_N * G) // G) % 2 == 1)[:, None]
            else:
                is_up = (offs_c % 2 == 1)[:, None]  # [BN, 1]
        else:
            s_ptr = Scale + (pid_n * BLOCK_N // 128) * tl.cdiv(K, 128)
            s_up_ptr = s_ptr
            is_up = None
        range_check: tl.constexpr = F16_DOT and X.dtype.element_ty == tl.bfloat16
        acc, amax = _dot_steps(w_ptrs, x_ptrs, offs_x, s_ptr, s_up_ptr, is_up, None, k_lo, k_hi,
                               offs_k, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN_K, W_SCALE,
                               F16_DOT, False, range_check, DOT_PRECISION, DIAG, nw_ptrs,
                               NORM_X)  # fmt: skip
        if range_check:
            redo = (amax > _F16_MAX) | ((amax < _X_SMALL) & (amax > 0))  # [XM]
            if tl.max(redo.to(tl.int32), 0) > 0:  # rare: the steps again, those rows scaled
                # (a row under 2^-113, or flushed to 0 by log2: scaled by 2^100 at most, where
                # 2^-e would overflow float32)
                e = tl.where(redo, tl.maximum(tl.floor(tl.log2(amax)) - 14, -100.0), 0.0)
                acc, _ = _dot_steps(w_ptrs, x_ptrs, offs_x, s_ptr, s_up_ptr, is_up, tl.exp2(-e),
                                    k_lo, k_hi, offs_k, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
                                    EVEN_K, W_SCALE, F16_DOT, True, False, DOT_PRECISION,
                                    DIAG, nw_ptrs, NORM_X)  # fmt: skip
                acc *= tl.trans(_rows(tl.exp2(e)[:, None], BLOCK_M))  # [1, BM]
        acc = tl.trans(acc)  # [BM, BN]
    else:  # M = 1, unquantized: x [1, BK] broadcast over the rows, summed once at the end
        x_ptrs = X + (k_lo + offs_k)[None, :]  # [1, BK]
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs, eviction_policy="evict_last")
                if NORM_X:
                    nw = tl.load(nw_ptrs, eviction_policy="evict_last")
            else:
                k_mask = (k0 + offs_k) < k_hi
                w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_last")
                if NORM_X:
                    nw = tl.load(nw_ptrs, mask=k_mask[None, :], other=0.0,
                                 eviction_policy="evict_last")  # fmt: skip
            if NORM_X:
                x = x * nw
            acc2 += w.to(tl.float32) * x.to(tl.float32)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
            if NORM_X:
                nw_ptrs += BLOCK_K
        acc = tl.sum(acc2, 1)[None, :]  # [1, BN]
    if NORM_X:  # out[m] of x[m] * nw is 1 / rms(x[m]) times out[m] of rms_norm(x)[m]
        acc *= _rms_scale(norm_sums, K, norm_eps, BLOCK_M)

    if SPLIT:  # partials by weight row: [S, M, N]
        out_mask = (offs_m < M)[:, None] & n_mask[None, :]
        part = Part + offs_m[:, None] * N + offs_n[None, :]  # [BM, BN]
        tl.store(part + pid_k * M * N, acc, mask=out_mask)
        # The last of the S programs of this tile sums all S partials: a barrier (every
        # thread's partial stores issued), then one acq_rel atomic at GPU scope (releases
        # them; the last one acquires everyone else's).
        tl.debug_barrier()
        done = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if done == num_splits - 1:
            tl.store(Counters + pid_n, 0)  # zero again for the next launch (CUDA graphs)
            offs_s = tl.arange(0, MERGE_S)
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s0 in range(0, num_splits, MERGE_S):  # one round trip per MERGE_S splits
                idx = s0 + offs_s  # [MS]
                ptrs = part[None, :, :] + idx[:, None, None] * M * N  # [MS, BM, BN]
                live = (idx < num_splits)[:, None, None] & out_mask[None, :, :]
                total += tl.sum(tl.load(ptrs, mask=live, other=0.0, cache_modifier=".cg"), 0)
            _store_out(total, Bias, Scale, Out, Send, tag, offs_m, offs_n, n_mask, col0, M,
                       n_out, stride_om, HAS_BIAS, W_SCALE == 1, GATED, LIBDEVICE, FOLD, Res,
                       stride_rm, SumSq, pid_n, tl.num_programs(0), ADD_RES)  # fmt: skip
    else:
        _store_out(acc, Bias, Scale, Out, Send, tag, offs_m, offs_n, n_mask, col0, M, n_out,
                   stride_om, HAS_BIAS, W_SCALE == 1, GATED, LIBDEVICE, FOLD, Res, stride_rm,
                   SumSq, pid_n, tl.num_programs(0), ADD_RES)  # fmt: skip


# ---- tuning: `python -m kernels.bench_gemv --wide`, H100 (132 SMs, copy 3.02 TB/s), bf16,
# CUDA-graph replay, Llama-3-8B shapes at M = 1, 8, 16, 28-42 configs per point.

# M = 1, (BLOCK_N, BLOCK_K, num_warps, num_stages): (4, 2048, 4, 3) where K pads to a multiple
# of 2048 by at most a tenth (_TILE_M1_LONG_PAD); else (8, 1024, 4, 3). H100, 2026-11-24,
# medians of 3 alternated rounds, us, (4, 2048) vs (8, 1024): Llama-3-8B qkv 18.4 / 18.7,
# o_proj 13.1 / 14.5, gate_up 76.4 / 77.8, down 40.4 / 45.4, lm_head 331.6 / 335.9; Qwen3-8B
# o 13.2 / 14.7, down 35.3 / 39.5; Gemma-3-12B (K 3840) o 12.5 / 14.0, down 41.5 / 47.3; every
# other shape within 1%; Phi-4 (K 5120, a 20% pad) qkv 28.8 / 27.9, o 20.5 / 20.0: the pad
# costs there. BLOCK_N 32 or 8 warps up to 40% slower (the 2026-11-21 sweep).
_TILE_M1 = (8, 1024, 4, 3)
_TILE_M1_LONG = (4, 2048, 4, 3)
_TILE_M1_LONG_PAD = 0.1
# Short K and at most 4,096 rows (a tensor-parallel rank's layers; o_proj whole): (8, 512, 4, 3),
# 14 K steps where the tiles above take 1-7. H200, 2026-11-27 (`python -m kernels.bench_gemv
# --wide --diag --ms 1 --shapes qkv_tp2,o_proj_tp2,down_tp2,o_proj`, docs/benchmarks/
# tensor-parallel.md), us, (8, 512, 4, 3) against the rule above: Llama-3-8B at TP=2 qkv
# 3072 x 4096 7.99 / 8.70, o_proj 4096 x 2048 5.91 / 6.78, down 4096 x 7168 15.59 / 18.38;
# o_proj 4096 x 4096 9.73 / 10.10. Wider layers (qkv 6144 rows: 16.9 / 13.8) and long K keep
# the rule above.
_TILE_M1_SHORT = (8, 512, 4, 3)
_TILE_M1_SHORT_MAX_N = 4096
_TILE_M1_SHORT_MAX_K = 8192
# Under one 8-row tile per SM, 4-row tiles: qkv at tensor parallel 8 (768 rows) 4.5 us vs 4.9,
# 256 rows x 14336 5.9 vs 6.1 (at 5 splits; 7.9 unsplit).
_TILE_M1_NARROW = (4, 1024, 4, 4)
# M > 8 (tl.dot, M padded to 16): BLOCK_N 64 (wgmma) is best where it gives >= ~0.7 programs
# per SM (qkv M=8: 20.1 us vs 22.7 at BLOCK_N 32; gate_up 81.1 vs 86.1; lm_head 345 vs 349);
# below that BLOCK_N 32 (o_proj M=16: 14.9 us vs 15.7 at 64; down: 43.6 vs 46.5).
_TILE_DOT_WIDE = (64, 256, 4, 3)
_TILE_DOT_NARROW = (32, 256, 4, 4)
_WIDE_TILES_PER_SM = 0.7
# M = 2-8: diag on one-warp mma.sync tiles, 16 rows where they give >= 2.5 programs per SM,
# else 32. H100, M = 8, 2026-11-27 (`python -m kernels.bench_gemv --diag --ms 8`; fp8.md's
# session 16), us, diag against the wgmma tiles above: qkv (16) 19.4 / 20.1, gate_up (16)
# 79.9 / 81.5, lm_head (16) 342 / 344, o_proj (32) 13.8 / 14.7, down (32) 42.3 / 44.1 (the
# best of 34-35 tiles within 0.5 us everywhere); bench decode at batch 8, 4K: 7.61 -> 7.10
# ms a step (decode.md).
_TILE_DIAG = (16, 256, 1, 6)
_TILE_DIAG_NARROW = (32, 256, 1, 4)
_DIAG_PROGRAMS_PER_SM = 2.5
_DIAG_MAX_M = _DIAG_COLS.value  # diag's dot is 8 columns wide: M rows of 8 / M chunks
# Split-K costs ~1.5 us (the partials' round trip and the last program's serial sum): no shape
# above gained from it (o_proj M=1 (16, 512): 13.9 us unsplit, 15.1 at 2 splits; M=16 (32, 256):
# 14.9 / 16.2 at 3; (64, 256), 64 programs: 15.5 unsplit, 17.8 at 4). Only grids of fewer than
# 0.25 programs per SM split, to about one program per SM, where it pays: 768 x 4096 at M = 8
# (24 tiles of 32 rows) 6.5 us at 4 splits, 9.7 unsplit; 256 x 14336, 8 tiles: 8.0 / 27.4.
_SPLIT_BELOW_TILES_PER_SM = 0.25
_MIN_SPLIT_K = 1024  # K elements per split at least


def split_k_for(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """K-splits: 1 unless the N tiles number under ``_SPLIT_BELOW_TILES_PER_SM`` per SM; then
    enough to give every SM one program, none shorter than ``_MIN_SPLIT_K`` (nor one K tile)."""
    tiles_n = triton.cdiv(n, block_n)
    if tiles_n >= _SPLIT_BELOW_TILES_PER_SM * num_sms:
        return 1
    return max(1, min(triton.cdiv(num_sms, tiles_n), k // max(_MIN_SPLIT_K, block_k)))


# float8 weights (W_SCALE 1, 2), every M on tl.dot (M padded to 16; ``diag`` aside).
# H200 (132 SMs, copy 4,247 GB/s), M = 1, Llama-3-8B shapes, graph replay, 2026-11-27
# (`python -m kernels.bench_fp8 --sweep --ms 1`, docs/benchmarks/fp8.md), µs per channel /
# block scales, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages):
# - 128-row tiles of 2 warps (mma.sync, 64 rows a warp share x's fragments: 1.54 SASS per
#   weight byte, the fewest) where they give every SM one: gate_up (224 tiles) 30.0 / 29.3
#   (92 / 94% of copy; the 1-2 warp 16-32-row tiles 31.4-39.0).
# - else 16-row tiles of one warp, unsplit, where they give >= 2.5 programs per SM: qkv
#   (384) 9.8 / 9.1 (the 64-row 4-warp wgmma tile this replaced: 12.2 / 22.5).
# - else 32-row one-warp tiles split over K to ~3.5 programs per SM: o_proj (128 tiles, 4
#   splits) 7.6 / 7.0 (was 11.4 / 22.0; unsplit 16-row tiles 9.0+), down 17.4 / 16.9 (was
#   32.7 / 74.2). A one-warp program streams too little alone: fill the SMs with them.
# Then diag (H100, M = 1, per channel, 2026-11-27, `kernels.bench_fp8 --sweep --ms 1`, 60+
# tiles a shape): on the 16-row one-warp tile it is the fastest tile of every narrow shape,
# unsplit, from one program per SM: qkv 11.35 (11.68 without diag), o_proj 8.32 (9.58; the
# split 32-row tile 9.41), down 22.92 (25.54; split 24.34). So 16-row diag tiles from one
# program per SM, the split 32-row tiles below that. Per channel only: block scales (diag
# not yet timed with them) keep the rule above, without diag.
# M > 1 (not timed yet): 4 warps over 64 rows (wgmma) below one 128-row tile per SM: x's M
# rows are in every warp's registers (M = 16 on a one-warp tile spills).
_FP8_TILE_WIDE = (128, 128, 2, 4)
_FP8_TILE = (64, 256, 4, 4)
_FP8_TILE_NARROW = (16, 256, 1, 6)
_FP8_TILE_SPLIT = (32, 128, 1, 6)
_FP8_NARROW_PROGRAMS_PER_SM = 2.5
_FP8_DIAG_PROGRAMS_PER_SM = 1  # per channel (diag)
_FP8_SPLIT_PROGRAMS_PER_SM = 3.5
_FP8_MIN_SPLIT_K = 512  # K elements per split at least (4 tiles)

W_SCALE_NONE, W_SCALE_CHANNEL, W_SCALE_BLOCK = 0, 1, 2  # _linear_kernel's W_SCALE

# The register cap handed to ptxas (the launch's ``maxnreg``) for a float8 weight's one-warp
# tile with the residual add in its epilogue (the norm fold's producers, o_proj and down).
# Left to itself, ptxas gives the (16, 256, 1 warp, 6) diag tile 128 registers and a K loop of
# 184 SASS instructions, but any second store in the epilogue (the tile sums of squares, even
# one constant) made it pick 96 registers and 190 instructions with 7 NOPs between dependent
# HMMAs (sm_90 compile reports, Triton 3.6): 3.14 -> 4.99 cycles between issues, 1.48 -> 1.02
# TB/s (H100, Nsight Compute). Capped at 255 (one warp: no occupancy to lose) it takes 148
# registers and 174 instructions, no NOPs. H100, 2026-11-28, M = 1, µs plain / with the add
# (docs/benchmarks/gemv_norm_bench.py): o_proj 8.38 / 11.71 uncapped, 8.69 / 8.48 capped;
# down 23.00 / 32.30, 23.16 / 23.18. The cap slows the plain tiles a little (qkv 10.91 ->
# 11.19), so only the add takes it; wider tiles keep ptxas's choice (the 2-warp gate/up tile:
# 179 registers either way; a cap of 128 spills it).
_FP8_ONE_WARP_MAX_REGS = 255


def _fp8_config(
    m: int, n: int, k: int, num_sms: int, w_scale: int
) -> tuple[int, int, int, int, int, bool]:
    """``gemv_config`` for a float8 weight [n, k]."""
    channel = w_scale == W_SCALE_CHANNEL  # diag is timed with per-channel scales only
    narrow = _FP8_DIAG_PROGRAMS_PER_SM if channel else _FP8_NARROW_PROGRAMS_PER_SM
    diag = False
    if triton.cdiv(n, _FP8_TILE_WIDE[0]) >= num_sms:
        tile, split = _FP8_TILE_WIDE, 1
    elif m > 1:
        tile, split = _FP8_TILE, 1
    elif triton.cdiv(n, _FP8_TILE_NARROW[0]) >= narrow * num_sms:
        tile, split, diag = _FP8_TILE_NARROW, 1, channel
    else:
        tile = _FP8_TILE_SPLIT
        want = math.ceil(_FP8_SPLIT_PROGRAMS_PER_SM * num_sms / triton.cdiv(n, tile[0]))
        split = max(1, min(want, k // _FP8_MIN_SPLIT_K))
    block_n, block_k, warps, stages = tile
    return block_n, block_k, split, warps, stages, diag


def gemv_config(
    m: int, n: int, k: int, num_sms: int, w_scale: int = W_SCALE_NONE
) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, diag) for an [m, k] x [n, k]^T
    product; ``w_scale``: the weight is float8 with per-channel (1) or 128x128 block (2)
    scales."""
    if w_scale != W_SCALE_NONE:
        return _fp8_config(m, n, k, num_sms, w_scale)
    diag = 1 < m <= _DIAG_MAX_M
    if diag and triton.cdiv(n, _TILE_DIAG[0]) >= _DIAG_PROGRAMS_PER_SM * num_sms:
        tile = _TILE_DIAG
    elif diag:
        tile = _TILE_DIAG_NARROW
    elif m == 1 and triton.cdiv(n, _TILE_M1[0]) < num_sms:
        tile = _TILE_M1_NARROW
    elif m == 1 and n <= _TILE_M1_SHORT_MAX_N and k <= _TILE_M1_SHORT_MAX_K:
        tile = _TILE_M1_SHORT
    elif m == 1:
        pad = triton.cdiv(k, _TILE_M1_LONG[1]) * _TILE_M1_LONG[1] - k
        tile = _TILE_M1_LONG if pad <= _TILE_M1_LONG_PAD * k else _TILE_M1
    elif triton.cdiv(n, _TILE_DOT_WIDE[0]) >= _WIDE_TILES_PER_SM * num_sms:
        tile = _TILE_DOT_WIDE
    else:
        tile = _TILE_DOT_NARROW
    block_n, block_k, warps, stages = tile
    split = split_k_for(n, k, block_n, block_k, num_sms)
    return block_n, block_k, split, warps, stages, diag


def max_regs_for(num_warps: int, w_scale: int, add_res: bool) -> int:
    """The ``maxnreg`` a tile launches with (0: ptxas's own choice); ``add_res``: with the
    residual add in its epilogue."""
    one_warp_fp8 = w_scale != W_SCALE_NONE and num_warps == 1
    return _FP8_ONE_WARP_MAX_REGS if one_warp_fp8 and add_res else 0


def w_scale_kind(weight: torch.Tensor, weight_scale: torch.Tensor | None) -> int:
    """_linear_kernel's W_SCALE for a weight and its scales (None: not quantized), checked:
    a float8 e4m3 weight with float32 scales ``[N]`` or ``[cdiv(N, 128), cdiv(K, 128)]``."""
    if weight_scale is None:
        return W_SCALE_NONE
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a weight with scales must be float8_e4m3fn, got {weight.dtype}")
    if weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale must be contiguous float32, got {weight_scale.dtype}")
    if weight_scale.device != weight.device:
        raise ValueError(f"weight_scale on {weight_scale.device}, weight on {weight.device}")
    blocks = (triton.cdiv(n, 128), triton.cdiv(k, 128))
    if weight_scale.shape == (n,):
        return W_SCALE_CHANNEL
    if weight_scale.shape == blocks:
        return W_SCALE_BLOCK
    raise ValueError(f"weight_scale must be [{n}] (per channel) or {list(blocks)} (128x128 "
                     f"blocks); got {list(weight_scale.shape)}")  # fmt: skip


# one per output tile: the last K-split program of each sums the partials
_COUNTERS = SplitCounters("linear_small_m", 1 << 16)
_split_counters = _COUNTERS.take


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           w_scale: int) -> None:  # fmt: skip
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if not 1 <= x.shape[0] <= MAX_M:
        raise ValueError(f"linear_small_m takes 1 <= M <= {MAX_M} rows; got {x.shape[0]}")
    if weight.numel() == 0:
        raise ValueError(f"weight {tuple(weight.shape)} is empty")
    w_dtype = x.dtype if w_scale != W_SCALE_NONE else weight.dtype
    if x.dtype != w_dtype or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x {x.dtype} and weight {weight.dtype} must be one of fp16/bf16/fp32 "
                         "(or a float8 weight with its scales)")  # fmt: skip
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x rows (K) and weight must be contiguous")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    if bias is not None and (
        bias.shape != (weight.shape[0],) or bias.dtype != x.dtype or bias.stride(0) != 1
    ):
        raise ValueError(f"bias must be contiguous {x.dtype} [{weight.shape[0]}]; got "
                         f"{bias.dtype} {tuple(bias.shape)}")  # fmt: skip


def _check_config(block_n: int, block_k: int, split_k: int, use_dot: bool, w_scale: int) -> None:
    pow2 = all(b > 0 and b & (b - 1) == 0 for b in (block_n, block_k))
    if not pow2 or split_k < 1 or (use_dot and min(block_n, block_k) < 16):
        raise ValueError(f"config: BLOCK_N {block_n}, BLOCK_K {block_k} must be powers of two "
                         f"(>= 16 on tl.dot: M > 1 or float8), SPLIT_K {split_k} >= 1")  # fmt: skip
    if w_scale == W_SCALE_BLOCK and block_n > 128:
        raise ValueError(f"config: BLOCK_N {block_n} must be <= 128 with 128x128 block scales")


def linear_small_m(
    x: torch.Tensor,  # [M, K], rows contiguous, any row stride
    weight: torch.Tensor,  # [N, K] contiguous (nn.Linear layout); x's dtype or float8 e4m3
    bias: torch.Tensor | None = None,  # [N]
    out: torch.Tensor | None = None,  # [M, N], rows contiguous
    *,
    weight_scale: torch.Tensor | None = None,  # fp32 [N] or [cdiv(N, 128), cdiv(K, 128)]
    config: tuple[int, int, int, int, int] | None = None,
    chain: bool = True,
    act: str | None = None,  # "silu" or "gelu_tanh": the gated MLP's activation, out [M, N/2]
    fold: AllReduceFold | None = None,  # a row-parallel layer's output sent to the peer rank
    diag: bool | None = None,  # M <= 8: x's rows in chunks as the dot's 8 columns (module doc)
    residual: torch.Tensor | None = None,  # [M, N]: out = residual + the product, and its sums
    norm: RowNorm | None = None,  # x's rows RMSNormed as they are loaded
    max_regs: int | None = None,  # ptxas's register cap (0: its own); None: max_regs_for
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [M, N] in x.dtype ([M, N/2] with act)
    """``F.linear(x, weight, bias)`` for 1 <= M <= 16 (see module doc); fp32 accumulation.

    ``act``: ``weight`` is a gated MLP's fused ``[gate; up]`` projection (``[2I, K]``, gate
    rows first) and the output ``act(x @ gate.T) * (x @ up.T)`` ``[M, I]``, the activation
    taken on the fp32 sums (``kernels.reference.linear_act_and_mul`` up to rounding: one
    rounding, where the unfused path rounds the sums, the activation and the product). The
    tile (``config``, default ``gemv_config`` for all ``2I`` rows) streams the same weight
    rows per program as without: ``BLOCK_N / 2`` gate rows and the up rows of the same
    output columns, so the grid is the same too.

    With ``weight_scale`` the weight is float8 e4m3 (half the bytes streamed) and stands for
    ``weight * scale`` (``kernels.quant``): per-channel scales multiply each output column
    once, after the sum; 128x128 block scales multiply each K tile's products as it goes.
    ``config`` = (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) overrides ``gemv_config``
    (SPLIT_K is capped at the number of K tiles, and lowered so that no split is empty).
    ``chain``: join the decode layer's PDL chain where the device supports it
    (``kernels.common.pdl_chain``).

    ``fold``: the output is this rank's partial sum of a row-parallel layer under tensor
    parallelism on two ranks; it is also stored into the peer's slot of this call as words
    tagged with the call (``kernels.fold``): the norm after it adds the two. Not with
    ``act``.

    ``diag`` (M <= 8, BLOCK_K >= 128; any weight): the dot takes x's rows (M rounded up to a
    power of two) as 8 / M chunks each, side by side, against the weight tile viewed as 8 / M
    times the rows (``_dot_steps``), where it otherwise repeats x to 16 columns (and where M = 1
    on a float weight otherwise multiplies elementwise): half the MMAs and x converted once.
    None: ``gemv_config``'s choice without ``config``, off with it.

    ``max_regs``: the register cap handed to ptxas (``maxnreg``; 0 leaves the count to it);
    None takes ``max_regs_for`` the tile and weight.

    ``residual`` (a sublayer's last projection; not with ``act`` or ``fold``): ``out =
    residual + product``, both rounded to x's dtype first (``kernels.reference.add_rms_norm``'s
    sum), returned with ``sumsq`` [M, P] float32, each of the P output tiles' sum of ``out**2``
    by row: what the norm after the add needs, so that the GEMV reading the normed rows can
    apply it (``norm``) and the norm's own kernel goes. ``norm`` (``RowNorm``): x is the
    residual stream and the product is the one of ``rms_norm(x, norm.weight, norm.eps)``: x
    times the norm's weight as it is loaded (rounded to x's dtype), the sums times each row's
    ``1 / sqrt(mean(x**2) + eps)`` from ``norm.sumsq`` after the K loop. The values
    ``kernels.norm``'s kernel then this GEMV give, rounded elsewhere: that kernel rounds
    ``x / rms`` and its product with the weight, here ``x * weight`` is rounded and the 1 / rms
    multiplies the float32 sums.
    """
    w_scale = w_scale_kind(weight, weight_scale) if weight.dim() == 2 else W_SCALE_NONE
    _check(x, weight, bias, w_scale)
    m, k = x.shape
    n = weight.shape[0]
    gated = _gated(act, n)
    n_out = n // 2 if gated else n
    if out is None:
        out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n_out}] with contiguous rows")
    if fold is not None:
        if gated:
            raise ValueError("fold takes a row-parallel layer's output, not a gated one")
        fold.check(out, "the GEMV's output")
    if residual is not None:
        if gated or fold is not None:
            raise ValueError("residual takes a projection's own output: not with act or fold")
        if residual.shape != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must be {x.dtype} [{m}, {n}] with contiguous rows; got "
                             f"{residual.dtype} {tuple(residual.shape)}")  # fmt: skip
    if norm is not None:
        norm.check(x)
    if config is None:
        *config, picked = gemv_config(m, n, k, _num_sms(x.device), w_scale)
        diag = picked if diag is None else diag
    block_n, block_k, split_k, num_warps, num_stages = config
    diag = bool(diag)
    fp8 = w_scale != W_SCALE_NONE
    use_dot = m > 1 or fp8 or diag
    _check_config(block_n, block_k, split_k, use_dot, w_scale)
    if diag and not (m <= _DIAG_MAX_M and block_k >= 128):
        raise ValueError(f"diag takes M <= {_DIAG_MAX_M} and BLOCK_K >= 128; got M = {m}, "
                         f"BLOCK_K {block_k}")  # fmt: skip
    if gated and block_n < 2:
        raise ValueError(f"config: BLOCK_N {block_n} must be >= 2 with act (gate and up rows)")
    if gated and w_scale == W_SCALE_BLOCK and n_out % (block_n // 2):
        raise ValueError(f"with act and 128x128 block scales I = {n_out} must be a multiple "
                         f"of BLOCK_N / 2 = {block_n // 2} (the tile's up rows in one block "
                         "row)")  # fmt: skip
    tiles_n, tiles_k = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    per_split = triton.cdiv(tiles_k, min(split_k, tiles_k))
    splits = triton.cdiv(tiles_k, per_split)
    if splits > 1:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        counters = _split_counters(x.device, tiles_n)
    else:
        part = counters = out  # unused
    block_m = triton.next_power_of_2(m) if diag else 16 if use_dot else 1
    sumsq = None
    if residual is not None:
        sumsq = torch.empty((m, tiles_n), dtype=torch.float32, device=x.device)
    if max_regs is None:
        max_regs = max_regs_for(num_warps, w_scale, residual is not None)
    # ptxas's option: ROCm's Triton has no maxnreg (it refuses options it does not know)
    launch = {"maxnreg": max_regs} if max_regs and torch.version.hip is None else {}
    _linear_kernel[(tiles_n, splits)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out, part, counters,
        m, n, k, splits, per_split * block_k, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, USE_DOT=use_dot, EVEN_K=k % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=num_stages,
        MERGE_S=min(triton.next_power_of_2(splits), 8 if use_dot else 16),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", W_SCALE=w_scale,
        X_ROWS=triton.next_power_of_2(m) if fp8 else block_m,
        F16_DOT=fp8 and x.dtype != torch.float32, DIAG=diag, GATED=gated,
        LIBDEVICE=x.device.type == "cuda", num_warps=num_warps, **pdl_kwargs(x.device, chain),
        **launch,
        **_fold_args(fold), **_residual_args(residual, sumsq), **_norm_args(norm),
    )  # fmt: skip
    return out if residual is None else (out, sumsq)


def rows_compiled_apart() -> tuple[int, ...]:
    """The least row count M of each compile ``linear_small_m`` makes for one weight over
    1 <= M <= MAX_M: the tile (``gemv_config``: M = 1, 2-8, above), x's rows as the kernel takes
    them (a power of two: ``diag``'s BLOCK_M, float8's X_ROWS; 16 for the dot's padding) and
    Triton's kind of the integer M (1, a multiple of 16, other) set them apart. Launching the
    GEMV at each of these meets every compile it has for that weight (the engine's start-up
    warm-up does); ``tests/test_gemv.py`` checks it against the launches' arguments."""
    least: dict[tuple[int, bool, bool], int] = {}
    for m in range(1, MAX_M + 1):
        least.setdefault((triton.next_power_of_2(m), m == 1, m % 16 == 0), m)
    return tuple(least.values())


def _residual_args(residual: torch.Tensor | None, sumsq: torch.Tensor | None) -> dict:
    """_linear_kernel's ADD_RES arguments."""
    if residual is None:
        return dict(ADD_RES=False)
    return dict(Res=residual, SumSq=sumsq, stride_rm=residual.stride(0), ADD_RES=True)


def _norm_args(norm: RowNorm | None) -> dict:
    """_linear_kernel's NORM_X arguments."""
    if norm is None:
        return dict(NORM_X=False)
    parts = norm.sumsq.shape[1]
    return dict(NormSq=norm.sumsq, NormW=norm.weight, norm_parts=parts, norm_eps=norm.eps,
                NORM_PARTS=triton.next_power_of_2(parts), NORM_X=True)  # fmt: skip


def _fold_args(fold: AllReduceFold | None) -> dict:
    """_linear_kernel's FOLD arguments: the peer's slots, this rank's counter."""
    if fold is None:
        return dict(Send=None, Calls=None, stride_send=0, FOLD=False)
    return dict(Send=fold.send, Calls=fold.calls, stride_send=fold.send.stride(0), FOLD=True)


def _gated(act: str | None, n: int) -> int:
    """_linear_kernel's GATED for ``act`` over a fused gate/up weight of ``n`` rows."""
    if act is None:
        return 0
    if act not in GATED_ACTS:
        raise ValueError(f"act must be one of {', '.join(GATED_ACTS)} or None, not {act!r}")
    if n % 2:
        raise ValueError(f"a gated weight [gate; up] has an even number of rows; got {n}")
    return GATED_ACTS[act]


def _fuses(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """Whether ``linear_act_and_mul`` takes the fused kernel: where ``linear`` streams the
    weight, unless block scales meet an I that is not a multiple of 64 (BLOCK_N / 2 for any
    tile block scales take; every model's: fused block-scaled weights need I % 128 == 0)."""
    block = weight_scale is not None and weight_scale.dim() == 2
    return _streams(x, weight) and not (block and (weight.shape[0] // 2) % 64)


def _streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` takes ``linear_small_m`` for these operands: CUDA and
    ``streamable_shapes``."""
    return x.is_cuda and streamable_shapes(x, weight)


def streamable_shapes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Decode batch sizes (1 <= T <= MAX_M), contiguous weight and rows: the operands
    ``linear_small_m`` takes on any device (``_streams`` adds CUDA)."""
    return x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.stride(1) == 1 and weight.is_contiguous()


def linear(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None = None,  # [N]
    weight_scale: torch.Tensor | None = None,  # fp32 [N] or [cdiv(N, 128), cdiv(K, 128)]
    *,
    chain: bool = True,
    fold: AllReduceFold | None = None,
    norm: RowNorm | None = None,
) -> torch.Tensor:  # [T, N]
    """``F.linear`` for the Triton backend: ``linear_small_m`` on CUDA at decode batch sizes
    (1 <= T <= MAX_M, contiguous weight and rows, taking ``chain`` as it does); above, cuBLAS,
    or for a float8 weight ``kernels.fp8.fp8_linear`` (FP8 tensor cores). ``fold`` (a
    row-parallel layer's all-reduce folded into this GEMV and the norm after it): always
    ``linear_small_m``, which refuses operands it cannot stream. ``norm``: of
    ``rms_norm(x, norm.weight, norm.eps)``, normed as the GEMV loads x (elsewhere by the norm's
    kernel first)."""
    if fold is not None or _streams(x, weight):
        return linear_small_m(x, weight, bias, weight_scale=weight_scale, chain=chain, fold=fold,
                              norm=norm)  # fmt: skip
    if norm is not None:
        x = rms_norm(x, norm.weight, norm.eps, chain=chain)
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    return torch.nn.functional.linear(x, weight, bias)


# GPUs on which folding the norms into the GEMVs (``fuses_norms``) measured faster, by a
# substring of their names: the H100 SXM (below; torch names it "NVIDIA H100 80GB HBM3"; the
# PCIe and NVL H100s, with other memory, were not measured). Not the H200 (2026-11-28,
# session 28, bench decode as below, runs alternated with the fold turned off): bf16 3.4 /
# 2.9 / 1.5% slower a step at 4K / 32K / 128K (4.34 / 5.16 / 7.93 ms against 4.20 / 5.01 /
# 7.81); fp8 weights and cache level at 4K and 32K (within the runs' 3% spread), 1% faster at
# 128K. Its GEMVs alone (gemv_norm_bench.py) take +4.0 us a layer for the fold's parts against
# the H100's +1.2: the normed GEMVs' loads of the producer's tile sums (512-1,024 floats a row,
# each program) no longer hide under the faster weight stream (qkv +1.6 us, gate/up +2.9; with
# one sum a row +0.4 and +0.9). Other GPUs: not measured, not folded.
NORM_FOLD_DEVICES = (("H100 80GB HBM3", True),)  # kernels.common.measured_for's table form


def norm_fold_pays(device_name: str) -> bool:
    """Whether ``fuses_norms`` folds on a GPU of this name (``NORM_FOLD_DEVICES``)."""
    return measured_for(device_name, NORM_FOLD_DEVICES, False)


def fuses_norms(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the norm between two projections of ``weight``'s dtype should be folded into
    their GEMVs (``linear_add``, then ``linear(norm=)``) for activations like ``x`` [T, K]:
    CUDA on a GPU where it measured faster (``NORM_FOLD_DEVICES``), decode batch sizes, 16-bit
    or float8 e4m3 weights. H100, 2026-11-28
    (docs/benchmarks/fp8.md, sessions 25 and 27), M = 1, Llama-3.1-8B shapes, µs without / with
    the fold's part: bf16 o_proj 12.80 / 13.06, down 39.72 / 40.07, qkv 18.29 / 18.68, gate_up
    76.09 / 76.32 (bench decode: 1.0-1.4% faster a step at 4K-128K); fp8 per channel qkv 10.91
    / 11.10, gate_up 44.35 / 44.79, o_proj 8.38 / 8.48 and down 23.00 / 23.18 (the last two
    with ``max_regs_for``'s cap; 11.71 and 32.30 without it); bench decode over fp8 weights and
    an fp8 cache 1.1 / 1.5 / 1.1% faster a step at 4K / 32K / 128K."""
    return (x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= MAX_M
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
            and measured_on(x.device, NORM_FOLD_DEVICES, False))  # fmt: skip


def linear_add(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None,  # [N]
    weight_scale: torch.Tensor | None,  # fp32 [N] or [cdiv(N, 128), cdiv(K, 128)]
    residual: torch.Tensor,  # [T, N], the residual stream
    *,
    chain: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # residual + linear(x), sumsq [T, P] float32
    """A sublayer's last projection added to the residual stream
    (``kernels.reference.linear_add``), with the partial sums of squares of the sum's rows
    that the next norm needs (``RowNorm``): where ``linear`` streams the weight, its GEMV's
    tiles' (``linear_small_m(residual=)``); elsewhere one sum a row."""
    if _streams(x, weight):
        return linear_small_m(x, weight, bias, weight_scale=weight_scale, chain=chain,
                              residual=residual)  # fmt: skip
    h = residual + linear(x, weight, bias, weight_scale, chain=chain)
    return h, h.float().square().sum(-1, keepdim=True)


def linear_act_and_mul(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [2I, K], [gate; up]: x's dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None = None,  # [2I]
    weight_scale: torch.Tensor | None = None,  # fp32 [2I] or [cdiv(2I, 128), cdiv(K, 128)]
    act: str = "silu",  # or "gelu_tanh"
    *,
    chain: bool = True,
    norm: RowNorm | None = None,
) -> torch.Tensor:  # [T, I]
    """A gated MLP's gate/up projection and activation, ``act(gate) * up``, for the Triton
    backend (``kernels.reference.linear_act_and_mul``): where ``linear`` streams the weight
    (``_streams``), one ``linear_small_m`` with the activation in its epilogue (one launch
    fewer a layer; ``_fuses``); elsewhere (prefill sizes, the CPU) ``linear``, then the
    activation kernel. ``norm`` as ``linear``'s.
    Both join the PDL chain as ``chain`` says."""
    if act not in _ACT_AND_MUL:
        raise ValueError(f"act must be one of {', '.join(_ACT_AND_MUL)}, not {act!r}")
    if _fuses(x, weight, weight_scale):
        return linear_small_m(x, weight, bias, weight_scale=weight_scale, chain=chain, act=act,
                              norm=norm)  # fmt: skip
    gate_up = linear(x, weight, bias, weight_scale, chain=chain, norm=norm)  # [T, 2I]
    return _ACT_AND_MUL[act](gate_up, chain=chain)


_ACT_AND_MUL = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}  # the unfused path's
