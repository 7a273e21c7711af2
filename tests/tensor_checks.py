"""Comparing a kernel's output with its float64 (or float32) reference, and capturing its calls
in a CUDA graph, for the kernel tests."""

from __future__ import annotations

import torch

from kernels import quant

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
# the linear-layer kernels' tests (GEMV, fp8): their dtypes (the interpreter miscomputes tl.dot
# on bf16 operands: bf16 on the GPU only) and tolerances (the output's rounding dominates:
# fp16 ~3e-4, bf16 ~2.5e-3 relative); the weight quantizers by scale layout
GEMV_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if GPU else [])
GEMV_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
QUANTIZE = {"channel": quant.quantize_per_channel, "block": quant.quantize_blocks}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out - ref‖ / ‖ref‖`` in float64 (a zero reference counts as a tiny one)."""
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """Relative error under ``tol``, no NaN; on failure say where the worst element is."""
    diff = (out.double() - ref.double()).abs()
    nan = torch.isnan(out)
    err = rel_err(out, ref)
    if nan.any() or not err <= tol:
        where = nan.nonzero()[0] if nan.any() else (diff == diff.max()).nonzero()[0]
        idx = tuple(where.tolist())
        raise AssertionError(
            f"{what}: rel err {err:.3e} > {tol:.1e}; {int(nan.sum())} NaN; worst at {idx}: "
            f"got {out[idx].item():.6f}, want {ref[idx].item():.6f}"
        )


def capture_graph(fn):
    """``(graph, fn())`` with ``fn``'s calls captured in a CUDA graph: run once on a side
    stream first (Triton compiles, allocators settle: nothing of that may happen in a capture),
    then captured; ``graph.replay()`` reruns it on the tensors it captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def cu_of(lens, device: str | None = None) -> torch.Tensor:  # [B + 1] int32
    """``[0, l0, l0 + l1, ...]``: the offsets of sequences of ``lens`` tokens laid back to
    back, as the attention kernels take them (``cu_seqlens_q``); on ``device`` (default: the
    GPU where there is one, as the tests' ``DEVICE``)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)  # fmt: skip


def head_major_copy(pool: torch.Tensor) -> torch.Tensor:
    """A KV pool ``[N, PAGE, Hkv, D]`` with the same values (bytes: e4m3 NaN too), stored a
    head's rows of a page together (``kv_quant.new_kv_pool(head_major=True)``)."""
    from kernels.kv_quant import new_kv_pool

    out = new_kv_pool(*pool.shape, pool.dtype, pool.device, head_major=True)
    out.view(torch.uint8).copy_(pool.view(torch.uint8))
    return out
