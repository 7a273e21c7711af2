"""Launch-side helpers shared by the Triton kernels: device facts, PDL support, the paged cache
checks, and the zeroed counters of in-kernel merges."""

from __future__ import annotations

import functools
import math
import operator

import torch
import triton
import triton.language as tl

from kernels.kv_quant import check_kv_scales

# Triton specializes an integer argument by kind (1, a multiple of 16, other) and compiles the
# kernel again for each new kind, in the middle of serving. The prefill kernels' step counts, its
# query tiles and number of prompts, change kind from step to step; they only find a program's
# work item, never the KV loop, so they are not specialized: one compile serves every step
# (after the start-up warm-up, a fresh server under a mixed load compiled the Gluon prefill
# kernel 9 times with them specialized, 1 without; docs/benchmarks/serving.md, session 33).
# Measured on an H200: the Gluon and portable paths level, the Hopper fallback 12% slower at
# 64-token pages and level at 128 (the engine's default on sm_90).
PREFILL_STEP_INTS = ("n_tiles", "n_seqs")
# The block tables' row stride is an integer argument of every attention kernel; the engine keeps
# it of one kind instead (``table_columns``), which keeps its divisibility known to the kernels
# and the tables after the decodes' rows 16-byte aligned.
TABLE_COLUMNS_MULTIPLE = 16


def table_columns(longest: int) -> int:
    """Columns of a step's block tables: its longest table (at least 1) rounded up to a
    multiple of ``TABLE_COLUMNS_MULTIPLE``, so that the kernels' row stride is always of one
    kind to Triton (no compile for a new width) and divisible by 16."""
    m = TABLE_COLUMNS_MULTIPLE
    return max(1, -(-longest // m)) * m


def measured_for(device_name: str, table: tuple, default):
    """The value a per-GPU tuning table (``(part of a GPU's name, value)`` pairs, the first
    match wins) holds for a GPU of this name, else ``default``: the choices that measured
    differently on some GPUs (``kernels.decode.DEVICE_DECODE_TUNING``,
    ``kernels.gemv.NORM_FOLD_DEVICES``)."""
    return next((value for part, value in table if part in device_name), default)


@functools.cache
def measured_on(device: torch.device, table: tuple, default):
    """``measured_for`` of the device's GPU (``default`` off CUDA), once a device and table."""
    if device.type != "cuda":
        return default
    return measured_for(torch.cuda.get_device_name(device), table, default)


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: keep grids small
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def pdl_trigger(device: torch.device) -> bool:
    """Whether a kernel on ``device`` can let a PDL-launched successor start early (sm_90+)."""
    extra = getattr(tl, "extra", None)
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device)[0] >= 9
        and hasattr(getattr(extra, "cuda", None), "gdc_launch_dependents")
    )


@functools.cache
def pdl_wait(device: torch.device) -> bool:
    """Whether a kernel on ``device`` can be launched early and wait in-kernel for the one
    before it (sm_90+, a Triton with ``gdc_wait``)."""
    return pdl_trigger(device) and hasattr(tl.extra.cuda, "gdc_wait")


# Programmatic dependent launch along the decode layer (sm_90+): each of the layer's kernels
# (norms, linear layers, RoPE and KV write, attention, SiLU) is launched early, waits in-kernel
# for the one before it, then lets the next one launch, so each launch overlaps the previous
# kernel's last wave. The launchers take it as ``chain=`` (EngineConfig.pdl_chain, through the
# backend). H100, Llama-3-8B shape, batch 1, async scheduling, off / on alternated twice: 4K
# 5.97, 5.95 / 5.86, 5.86 ms per step; 32K 7.21, 7.20 / 7.09, 7.09 (docs/benchmarks/decode.md).
def pdl_chain(device: torch.device, chain: bool) -> bool:
    """Whether kernels on ``device`` join the PDL chain: asked for (``chain``) and possible
    there (sm_90+, a Triton with ``gdc_wait``)."""
    return chain and pdl_wait(device)


def pdl_kwargs(device: torch.device, chain: bool) -> dict:
    """Launch arguments of a kernel that may join the chain: its ``CHAIN`` constexpr
    (``pdl_enter``), and an early launch when it joins."""
    on = pdl_chain(device, chain)
    return {"CHAIN": on, "launch_pdl": True} if on else {"CHAIN": False}


@triton.jit
def pdl_enter(CHAIN: tl.constexpr, TRIGGER: tl.constexpr = False):
    """First thing in a chained kernel: wait until the kernel before it has finished and its
    writes are visible, then let the kernel after it launch (it waits the same way).
    ``TRIGGER`` without the chain: only let a PDL-launched successor start early (a kernel
    that waits later itself, as ``kernels.rope`` does, passes its chain here)."""
    if CHAIN:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()


_LOG2E = 1.4426950408889634


def check_window_softcap(window: int, softcap: float) -> tuple[int, float]:
    """A layer's sliding window (tokens, 0: none) and logit soft-cap (0: none) as the attention
    launchers take them: host numbers, ValueError if negative or not numbers."""
    try:
        w = -1 if isinstance(window, bool) else operator.index(window)
    except TypeError:
        w = -1
    if w < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    try:
        cap = -1.0 if isinstance(softcap, bool) else float(softcap)
    except (TypeError, ValueError):
        cap = -1.0
    if not 0 <= cap < math.inf:
        raise ValueError(f"softcap must be a float >= 0 (0: no soft-capping), got {softcap!r}")
    return w, cap


def softcap_factors(scale: float, softcap: float) -> tuple[float, float]:
    """``(cap_in, cap_out)`` of ``softcap_log2`` for the scale and soft-cap of a layer; zeros
    (unused) without soft-capping."""
    if softcap <= 0:
        return 0.0, 0.0
    return 2.0 * scale * _LOG2E / softcap, softcap * _LOG2E


@triton.jit
def _pow2(e):
    """2^e as float32 for integer ``e`` in [-126, 127], from its exponent bits: exact."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def f16_queries(q):
    """Queries [BG, BD] (bf16 or fp16) for the f16 dots over an fp8 cache: ``q * 2^k`` in f16
    and ``2^-k``, which the scores are multiplied by, with 2^k putting the largest ``|q|`` in
    [2^13, 2^14) (exact: powers of two). f16's range is 2^-24 to 65,504, bf16's float32's: so
    scaled, any bf16 query fits (the K tiles' e4m3 values, up to 448, are exact in f16) and
    every element down to 2^-27 of the largest keeps f16's 11 bits (a bf16 query has 8);
    unscaled, a query past 65,504 would be inf. Once per program (decode) or query tile
    (prefill)."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    # floor(log2(amax)) from its exponent bits; an all-zero q (-127) clamped to stay normal
    e = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -100)
    return (q.to(tl.float32) * _pow2(13 - e)).to(tl.float16), _pow2(e - 13)


@triton.jit
def softcap_log2(x, cap_in, cap_out):
    """``cap_out * tanh(x * cap_in / 2)``: with ``softcap_factors``, ``x`` a raw dot product
    ``q . k``, the soft-capped score ``softcap * tanh(scale * x / softcap)`` in log2 units.
    tanh(y) = 1 - 2 / (exp(2y) + 1), written out (Triton 3.6 has no portable tanh): exp2
    overflows to inf for large y (giving 1) and underflows to 0 for very negative y (giving
    -1), never NaN; its absolute error is a few fp32 ulps of ``cap_out``."""
    return cap_out * (1.0 - 2.0 / (tl.exp2(x * cap_in) + 1.0))


def check_kv_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, hkv: int, d: int) -> None:
    """K and V pools ``[N, PAGE, Hkv, D]`` of one layout, contiguous head dim, PAGE a power of
    two; ValueError otherwise."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (hkv, d) or k_cache.stride(3) != 1:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not hold [N, BS, {hkv}, {d}] pages "
                         "with a contiguous head dim")  # fmt: skip
    page = k_cache.shape[1]
    if page & (page - 1):
        raise ValueError(f"page size {page} must be a power of two")


def check_cache_dtypes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """The caches are in the queries' dtype, or fp8 with their scale pools
    (``kernels.kv_quant.check_kv_scales``); ValueError otherwise."""
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ")
    if not check_kv_scales(k_cache, k_scale, v_scale) and q.dtype != k_cache.dtype:
        raise ValueError(f"q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} differ")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}")


class SplitCounters(dict):
    """Zeroed int32 counters, kept per device, for kernels whose last program of a group merges
    the group's partials (it finds out with an atomic add, then resets its counter). Every
    launch leaves them zero, so CUDA graphs replay with them; calls on one device must not
    overlap in time (one stream, as in the engine)."""

    def __init__(self, kernel: str, min_size: int):
        super().__init__()
        self.kernel = kernel
        self.min_size = min_size

    def take(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self.get(device)
        if buf is None or buf.numel() < n:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{self.kernel}: run it once outside CUDA-graph capture first (it allocates "
                    f"{n} split counters)"
                )
            buf = torch.zeros(max(n, self.min_size), dtype=torch.int32, device=device)
            self[device] = buf
        return buf
