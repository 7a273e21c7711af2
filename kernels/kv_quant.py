"""The FP8 KV cache format, shared by the Triton kernels and the torch reference (plain torch).

An fp8 cache stores each layer's K and V as ``float8_e4m3fn`` pages ``[N, BS, Hkv, D]`` (one byte
an element, half of bf16's) plus one scale per (token, KV head) for K and one for V, computed
where the token's K/V are written::

    scale = bf16(max(amax_d |x[d]|, FP8_AMAX_FLOOR) / 448)
    q[d] = e4m3(clamp(x[d] / scale, -448, 448))       round to nearest, ties to even
    x[d] ~ q[d] * scale                                 |error| <= 2^-4 |x[d]| (normal range)

448 is e4m3's largest finite value; dividing by the scale the token will be read with (the
bf16-rounded one) keeps every ``|x / scale| <= 448 * (1 + 2^-9)``, so the clamp moves the
largest element by at most 2^-9 of itself, under a quarter of e4m3's step there.

Scales live in pools ``[N, Hkv, BS]`` (``kv_scale_shape``): a KV head's scales of one page are
contiguous, so a decode tile of 64 tokens reads 128 contiguous bytes per head (a ``[N, BS, Hkv]``
layout would read a 32-byte sector for each 2-byte value). Per-token scales need no
calibration and follow each token's own range; checkpoint ``k_scale``/``v_scale`` tensors
(static per-layer scales) are not used (``flashserve.models.weights``).

Why bf16 scales (2 bytes) rather than float32 (4), chosen by accuracy: the quantization
divides by the stored (rounded) scale, so rounding the scale only moves the e4m3 grid a little.
The K/V round trip of the default model (SmolLM2-135M, 30 layers, the first 4,096 tokens of the
repository's text; docs/benchmarks/fp8_kv_scales.py) has a relative error of 2.1842e-2 (K) and
2.4595e-2 (V) with float32 scales, 2.1861e-2 and 2.4604e-2 with bf16 ones: 0.09% and 0.04% more
error, not 0.09% of the values. fp16 scales measure as float32's there but go subnormal below
an amax of 0.027 (6.1e-5 * 448); bf16 keeps float32's range. So the bytes decide: two bytes
beside 128 are 1.6% of a token's fp8 K/V at head dim 128, float32 scales 3.1%, and decode
reads them all. A bf16 scale times an e4m3 value (4 + 8 significant bits) is exact in float32,
so the kernels' and the reference's dequantized values are the same numbers.
"""

from __future__ import annotations

import torch

from kernels.quant import E4M3, E4M3_MAX

FP8_KV_DTYPE = E4M3  # the pages: the same e4m3 as fp8 weights (kernels.quant)
KV_SCALE_DTYPE = torch.bfloat16
FP8_MAX = E4M3_MAX  # e4m3's largest finite value
# amax floor: an all-zero head gets a scale that is a normal number in bf16 and float32 (and
# quantizes to zeros); any |x| this small is noise next to the other heads
FP8_AMAX_FLOOR = 2.0**-64
# The P.V dot of the kernels multiplies P by ``v_scale * V_SCALE_SHIFT`` and the output by its
# inverse: a power of two, exact. It lifts p * v_scale out of fp16's subnormals (below 6.1e-5:
# v_scale is amax / 448, ~2e-4 for a head whose values reach 0.1) without overflow
# (amax * 256 / 448 < amax <= fp16's max); bf16 and float32 are unaffected. The decode kernel
# runs its dots in f16 for bf16 queries too: there p * v_scale * 256 (p <= 1) overflows only
# for a V amax over 114,632, and where it is subnormal (p * amax < 1.1e-4) its rounding error
# is at most 2^-25 * 448 / 256 = 5.2e-8 of the output per token (before the division by the
# softmax sum >= 1), more than bf16's relative 2^-9 only for p * amax < 2.7e-5.
V_SCALE_SHIFT = 256.0


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is an fp8 KV pool (it then comes with scale pools)."""
    return cache.dtype == FP8_KV_DTYPE


# Pools whose pages hold a KV head's rows together: storage ``[N, Hkv, PAGE, D]`` seen as the
# ``[N, PAGE, Hkv, D]`` every kernel and the reference take (``new_kv_pool``), read through its
# strides. Only for fp8 pages of at least this many tokens. H100, the fp8 decode kernel
# ((128, 4, 3) tiles, graph replay, `kernels.bench --sweep layout,page --kv-dtype fp8`, µs at
# 1x128K / 8x16K / 32x16K, docs/benchmarks/fp8.md, 2026-11-27): heads together in 128-token
# pages 98.9 / 100.3 / 370.5 (91 / 90 / 97% of the copy bandwidth); token rows in 16-token
# pages (the engine's fp8 default) 106.9 / 108.3 / 400.9, in 64-token pages 103.2 / 103.0 /
# 388.9; heads together in 16-token pages 109.6 / 109.4 / 405.6 (2 KB runs: worse). A token's
# e4m3 row of one head is 128 bytes at head dim 128, a bf16 one 256, where the same sweep over
# bf16 moved 0.5-1.2% (docs/benchmarks/kernels.md), so bf16 and fp16 pools keep token rows.
HEAD_MAJOR_MIN_PAGE = 64


def head_major_pages(dtype: torch.dtype, page: int) -> bool:
    """Whether the engine's pools of ``dtype`` and ``page``-token pages hold a KV head's rows
    together (``HEAD_MAJOR_MIN_PAGE``)."""
    return dtype == FP8_KV_DTYPE and page >= HEAD_MAJOR_MIN_PAGE


def new_kv_pool(num_blocks: int, page: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, device: torch.device | str, head_major: bool = False,
                zeros: bool = False) -> torch.Tensor:  # fmt: skip
    """A K or V pool ``[N, PAGE, Hkv, D]``: token rows (contiguous), or with ``head_major`` the
    transposed view of ``[N, Hkv, PAGE, D]`` storage; ``zeros``: zero-filled, else empty."""
    alloc = torch.zeros if zeros else torch.empty
    if not head_major:
        return alloc(num_blocks, page, num_kv_heads, head_dim, dtype=dtype, device=device)
    pool = alloc(num_blocks, num_kv_heads, page, head_dim, dtype=dtype, device=device)
    return pool.transpose(1, 2)


def is_head_major(pool: torch.Tensor) -> bool:
    """Whether a pool ``[N, PAGE, Hkv, D]`` holds a head's rows of a page together."""
    return pool.shape[1] > 1 and pool.stride(2) > pool.stride(1)


def kv_scale_shape(num_blocks: int, block_size: int, num_kv_heads: int) -> tuple[int, int, int]:
    """The shape of a scale pool for pages ``[num_blocks, block_size, num_kv_heads, D]``: a
    head's scales of one page contiguous."""
    return (num_blocks, num_kv_heads, block_size)


def kv_bytes_per_token_layer(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take in one layer's pools: the pages, and the scales of an fp8
    cache."""
    if dtype == FP8_KV_DTYPE:
        per_head = head_dim * 1 + KV_SCALE_DTYPE.itemsize
    else:
        per_head = head_dim * dtype.itemsize
    return 2 * num_kv_heads * per_head


def check_kv_scales(
    k_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Whether the caches are fp8; ValueError unless an fp8 cache comes with both scale pools
    (``KV_SCALE_DTYPE``, ``kv_scale_shape``, contiguous) and any other cache with none."""
    if not is_fp8(k_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for fp8 caches; the cache is {k_cache.dtype}")
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    n, bs, hkv, _ = k_cache.shape
    want = kv_scale_shape(n, bs, hkv)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s.shape != want or s.dtype != KV_SCALE_DTYPE or not s.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {KV_SCALE_DTYPE} {want} "
                             f"([N, Hkv, BS]); got {s.dtype} {tuple(s.shape)}")  # fmt: skip
    return True


def quantize_fp8(
    x: torch.Tensor,  # [..., D], the activations' dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # q [..., D] float8_e4m3fn, scale [...] KV_SCALE_DTYPE
    """Per-row e4m3 quantization (module doc): ``x ~ q * scale[..., None]``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR)
    scale = (amax / FP8_MAX).to(KV_SCALE_DTYPE)
    q = (xf / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)
    return q, scale


def dequantize_fp8(
    q: torch.Tensor,  # [..., D] float8_e4m3fn
    scale: torch.Tensor,  # [...]
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., D] dtype
    """``q * scale``: exact in float32 and float64."""
    return q.to(dtype) * scale.to(dtype)[..., None]
