"""FP8 (e4m3) weights and activations in plain torch: quantization, dequantization, and the
reference the fp8 kernels are tested against.

A quantized weight ``W [N, K]`` is a float8 e4m3 tensor ``Q`` and float32 scales ``S`` with
``W ~ Q * S`` in one of two layouts:

- per channel: ``S [N]``, ``W[n, k] = Q[n, k] * S[n]`` (tensor-wise checkpoints too: each of
  their tensors' one scale fills the rows of that tensor);
- 128x128 blocks: ``S [cdiv(N, 128), cdiv(K, 128)]``, ``W[n, k] = Q[n, k] * S[n // 128,
  k // 128]`` (DeepSeek-V3's and the Qwen3 ``-FP8`` checkpoints' ``weight_scale_inv``).

A scale is ``amax / 448`` over its row or block (448: e4m3's largest finite value), so the
largest magnitude maps to 448; it is at least ``MIN_SCALE`` (a zero row quantizes to zeros, not
NaN). Values are clamped to [-448, 448] before the cast: torch turns a value past 448 into NaN
(e4m3 has no infinity), and ``x / scale`` can round a hair past 448.

Activations are quantized the same way on the fly, per token (one scale per row, for the
per-channel weights' ``torch._scaled_mm``) or per token and 128-column group (for the block
weights' kernel): ``quantize_activations``, whose Triton twin is ``kernels.fp8``'s.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
FP8_BLOCK = 128  # the block weights' scale blocks are FP8_BLOCK x FP8_BLOCK
# The smallest scale: a row of zeros (or of values under 448 * 1e-12) quantizes to zeros.
MIN_SCALE = 1e-12
_F32_MAX = torch.finfo(torch.float32).max


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` in float32, clamped to e4m3's range, rounded to e4m3 (nearest even)."""
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in float32, at least MIN_SCALE; an infinite amax counts as float32's
    largest value (its infinities then clamp to +-448, never NaN)."""
    return (amax.float().clamp(max=_F32_MAX) / E4M3_MAX).clamp_(min=MIN_SCALE)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [N, K] e4m3, S [N] float32)``: one scale per output row, ``amax(|row|) / 448``."""
    scale = _scale_of(w.abs().amax(dim=1))  # [N]
    return _to_e4m3(w, scale[:, None]), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q [N, K] e4m3, S [cdiv(N, 128), cdiv(K, 128)] float32)``: one scale per 128x128
    block, ``amax(|block|) / 448`` (the edge blocks hold what is left of N and K)."""
    n, k = w.shape
    b = FP8_BLOCK
    nb, kb = -(-n // b), -(-k // b)
    padded = torch.zeros(nb * b, kb * b, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    amax = padded.abs().view(nb, b, kb, b).amax(dim=(1, 3))  # [NB, KB]
    scale = _scale_of(amax)
    return _to_e4m3(w, expand_block_scales(scale, n, k)), scale


def expand_block_scales(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[cdiv(N, 128), cdiv(K, 128)] block scales -> [N, K], each element's own."""
    b = FP8_BLOCK
    return scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Q * S`` in ``dtype`` (computed in float32, or float64 for float64): per-channel
    scales ``[N]`` or block scales ``[cdiv(N, 128), cdiv(K, 128)]``."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    if scale.dim() == 1:
        s = scale.to(wide)[:, None]
    else:
        s = expand_block_scales(scale.to(wide), *w.shape)
    return (w.to(wide) * s).to(dtype)


def quantize_activations(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, ...]:
    """Per-token quantization of ``x [M, K]``: ``(Q [M, K] e4m3, S [M, G] float32)``, one
    scale per row (``group`` None: G = 1) or per row and ``group`` columns (G = cdiv(K,
    group)), each ``amax / 448`` of its values."""
    m, k = x.shape
    g = group or k
    groups = -(-k // g)
    padded = torch.zeros(m, groups * g, dtype=x.dtype, device=x.device)
    padded[:, :k] = x
    scale = _scale_of(padded.abs().view(m, groups, g).amax(dim=2))  # [M, G]
    full = scale.repeat_interleave(g, 1)[:, :k]
    return _to_e4m3(x, full), scale
