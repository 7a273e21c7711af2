"""Comparing a kernel's output with its float64 (or float32) reference, for the kernel tests."""

from __future__ import annotations

import torch


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
