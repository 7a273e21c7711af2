"""Linear layers with float8 e4m3 weights at prefill batch sizes (M > 16), on FP8 tensor cores.

Weights come as ``kernels.quant`` describes: ``W ~ Q * S``, Q [N, K] e4m3, S float32 per output
channel ``[N]`` or per 128x128 block ``[cdiv(N, 128), cdiv(K, 128)]``. The activations are
quantized on the fly (``quantize_activations``: one Triton launch), then:

- per channel: ``torch._scaled_mm`` (cuBLAS) with row-wise scales, activations per token::

      out[m, n] = (sum_k Qx[m, k] * Q[n, k]) * Sx[m] * S[n] + bias[n]

- blocks: ``block_fp8_matmul`` (Triton), activations per token and 128-column group, the
  128-wide K steps of the product each scaled by both sides' scales, fp32 accumulation::

      out[m, n] = sum_kb (sum_{k in kb} Qx[m, k] * Q[n, k]) * Sx[m, kb] * S[n // 128, kb]

Per-token scales keep an activation's relative error under e4m3's 1/16 per element whatever
the other tokens hold. Decode batch sizes (M <= 16) do not come here: they stream the weight
through ``kernels.gemv`` with the scales applied in that kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant import E4M3, E4M3_MAX, FP8_BLOCK, MIN_SCALE, dequantize

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_MIN_SCALE = tl.constexpr(MIN_SCALE)

# ---------------------------------------------------------------- activations


@triton.jit
def _quantize_rows_kernel(
    X,  # [M, K]
    Q,  # [M, K] e4m3, contiguous
    S,  # [M, G] fp32, contiguous: G = cdiv(K, group)
    K,
    group,  # columns per scale: 128, or K (one scale per row)
    num_groups,  # G
    stride_xm,
    BLOCK: tl.constexpr,
):
    """Program (m, g): s = max(amax(|x[m, group g]|) / 448, MIN_SCALE); q = clamp(x / s)."""
    m = tl.program_id(0)
    g = tl.program_id(1)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(lo, hi, BLOCK):
        x = tl.load(X + m * stride_xm + k0 + offs, mask=k0 + offs < hi, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0) / _E4M3_MAX, _MIN_SCALE)
    tl.store(S + m * num_groups + g, scale)
    for k0 in range(lo, hi, BLOCK):  # the row again: from L2, a group is small
        x = tl.load(X + m * stride_xm + k0 + offs, mask=k0 + offs < hi, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -_E4M3_MAX, _E4M3_MAX)
        tl.store(Q + m * K + k0 + offs, q.to(Q.dtype.element_ty), mask=k0 + offs < hi)


def quantize_activations(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, ...]:
    """``kernels.quant.quantize_activations`` in one launch: ``(Q [M, K] e4m3, S [M, G]
    float32)``, a scale per row (``group`` None) or per row and ``group`` columns."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [M, K] with contiguous rows; got {tuple(x.shape)}")
    m, k = x.shape
    g = group or k
    groups = triton.cdiv(k, g)
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        block = min(triton.next_power_of_2(g), 1024)
        _quantize_rows_kernel[(m, groups)](x, q, s, k, g, groups, x.stride(0), BLOCK=block,
                                           num_warps=4 if block >= 512 else 1)  # fmt: skip
    return q, s


# ---------------------------------------------------------------- block-scaled matmul


@triton.jit
def _block_fp8_matmul_kernel(
    A,  # [M, K] e4m3 activations, rows contiguous
    A_scale,  # [M, KB] fp32, KB = cdiv(K, 128)
    B,  # [N, K] e4m3 weight, contiguous
    B_scale,  # [cdiv(N, 128), KB] fp32
    Bias,  # [N] (HAS_BIAS)
    C,  # [M, N], rows contiguous
    M,
    N,
    K,
    stride_am,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % 128 == 0
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # divides 128: a tile's rows share one row of weight scales
    NUM_STAGES: tl.constexpr,
):
    """Program (i, j): C tile [BLOCK_M, BLOCK_N] over K in steps of 128 (one scale block):
    acc += dot(A_kb, B_kb^T) * A_scale[:, kb] * B_scale[n_block, kb]."""
    BLOCK_K: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kb_count = tl.cdiv(K, BLOCK_K)
    # rows past M or N are clamped to the last one (loaded, never stored): no row masks
    a_rows = tl.minimum(offs_m, M - 1).to(tl.int64)
    b_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]  # [BM, 128]
    b_ptrs = B + b_rows[:, None] * K + offs_k[None, :]  # [BN, 128]
    as_ptrs = A_scale + a_rows * kb_count  # [BM]
    bs_ptr = B_scale + (pid_n * BLOCK_N // 128) * kb_count
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in tl.range(0, kb_count, num_stages=NUM_STAGES):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_mask = (kb * BLOCK_K + offs_k) < K
            a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[None, :], other=0.0)
        sa = tl.load(as_ptrs + kb)  # [BM]
        sb = tl.load(bs_ptr + kb)
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages). Not measured yet: compile reports only (sm_90,
# Triton 3.9): (128, 128, 8, 3) and (64, 128, 4, 4) use wgmma with no spills. Below 128 rows a
# 64-row tile wastes less of the last M tile.
_BLOCK_TILE_LARGE = (128, 128, 8, 3)
_BLOCK_TILE_SMALL = (64, 128, 4, 4)


def block_matmul_config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of ``block_fp8_matmul`` for ``m`` rows."""
    return _BLOCK_TILE_LARGE if m > 64 else _BLOCK_TILE_SMALL


def block_fp8_matmul(
    a: torch.Tensor,  # [M, K] e4m3 (or fp16/fp32 holding e4m3 values: interpreter tests)
    a_scale: torch.Tensor,  # [M, cdiv(K, 128)] fp32
    b: torch.Tensor,  # [N, K] same dtype as a, contiguous
    b_scale: torch.Tensor,  # [cdiv(N, 128), cdiv(K, 128)] fp32
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:  # [M, N] out_dtype
    """``sum_kb dot(a_kb, b_kb^T) * a_scale[:, kb] * b_scale[n // 128, kb] + bias`` (module
    doc), fp32 accumulation. ``config`` overrides ``block_matmul_config``."""
    m, k = a.shape
    n = b.shape[0]
    kb = triton.cdiv(k, FP8_BLOCK)
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != k or a.dtype != b.dtype:
        raise ValueError(f"a [M, K] and b [N, K] of one dtype; got {a.dtype} "
                         f"{tuple(a.shape)}, {b.dtype} {tuple(b.shape)}")  # fmt: skip
    if a.stride(1) != 1 or not b.is_contiguous():
        raise ValueError("a's rows and b must be contiguous")
    if a_scale.shape != (m, kb) or b_scale.shape != (triton.cdiv(n, FP8_BLOCK), kb):
        raise ValueError(f"scales must be [{m}, {kb}] and [{triton.cdiv(n, FP8_BLOCK)}, {kb}]; "
                         f"got {tuple(a_scale.shape)}, {tuple(b_scale.shape)}")  # fmt: skip
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError("scales must be float32")
    if not (a_scale.is_contiguous() and b_scale.is_contiguous()):
        raise ValueError("scales must be contiguous")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias must be contiguous [{n}]; got {tuple(bias.shape)}")
    block_m, block_n, warps, stages = config or block_matmul_config(m)
    if block_n > FP8_BLOCK or FP8_BLOCK % block_n:
        raise ValueError(f"BLOCK_N {block_n} must divide {FP8_BLOCK}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_fp8_matmul_kernel[grid](
        a, a_scale, b, b_scale, bias if bias is not None else b_scale, out,
        m, n, k, a.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=k % FP8_BLOCK == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return out


# ---------------------------------------------------------------- per-channel: cuBLAS


def scaled_mm_linear(
    x: torch.Tensor,  # [M, K], rows contiguous
    weight: torch.Tensor,  # [N, K] e4m3, contiguous
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    """Per-channel fp8 weight times per-token fp8 activations on cuBLAS (``torch._scaled_mm``,
    row-wise scales). Its row-wise mode writes bf16 only: other dtypes are cast after."""
    xq, xs = quantize_activations(x)  # [M, K] e4m3, [M, 1]
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1),
                           out_dtype=torch.bfloat16)  # fmt: skip
    out = out.to(x.dtype)
    return out + bias if bias is not None else out


# ---------------------------------------------------------------- dispatch


def fp8_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] e4m3
    weight_scale: torch.Tensor,  # [N] or [cdiv(N, 128), cdiv(K, 128)] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x.dtype
    """``x @ dequantize(weight, weight_scale).T + bias`` with fp8 tensor cores on CUDA: per
    channel through ``scaled_mm_linear``, blocks through ``block_fp8_matmul``. Elsewhere, and
    for shapes cuBLAS's fp8 GEMM refuses (N or K not a multiple of 16), the reference:
    dequantize, then matmul in x's dtype."""
    if x.dim() != 2 or x.shape[0] == 0 or not x.is_cuda:
        return torch.nn.functional.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
    x = x if x.stride(1) == 1 else x.contiguous()
    if weight_scale.dim() == 2:
        xq, xs = quantize_activations(x, FP8_BLOCK)
        return block_fp8_matmul(xq, xs, weight, weight_scale, bias, x.dtype)
    n, k = weight.shape
    if n % 16 or k % 16:
        return torch.nn.functional.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
    return scaled_mm_linear(x, weight, weight_scale, bias)
