"""What a decode layer's small kernels cost the step: ``bench decode`` with some of them left
out, their outputs replaced by a constant (a view of one buffer, no kernel).

    python3 docs/benchmarks/layer_ablation.py SKIP bench decode --model dummy:llama3.1-8b ...

SKIP is a comma list (or ``none``):
- ``norm``: the residual add + RMSNorm between sublayers (``add_rms_norm``) returns the
  constant as the normed row and the sublayer's output as the residual: the GEMV after it
  waits on the GEMV before it, as it would if the norm lived in the GEMVs' epilogue/prologue;
- ``rope``: RoPE + the KV store (``rope_write_kv``) returns the constant as the queries and
  writes nothing: the attention waits on the QKV GEMV, as it would with RoPE in its epilogue.

The numbers are ceilings for fusing those kernels away (the outputs are wrong by design; the
values stay bounded: every layer reads the same constant). A measurement tool only; never
imported by the engine.
"""

from __future__ import annotations

import sys

import torch

from flashserve.cli.main import main
from flashserve.models import attention

_ROWS, _COLS = 8192, 8192  # the largest [T, hidden] or [T, Hq * D] a step may ask for


def _patch(skip: set[str]) -> None:
    build = attention.TritonBackend._ops
    buffers: dict[tuple, torch.Tensor] = {}

    def constant(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in buffers:  # the first call is an eager one (start-up), never a capture
            buffers[key] = torch.full((_ROWS * _COLS,), 0.02, dtype=like.dtype, device=like.device)
        n = 1
        for s in shape:
            n *= s
        return buffers[key][:n].view(shape)

    def ops(self):
        table = build(self)
        if "norm" in skip:

            def add_rms_norm(x, residual, weight, eps, *args, **kwargs):
                return constant(x, tuple(x.shape)), x

            table["add_rms_norm"] = add_rms_norm
        if "rope" in skip:

            def rope_write_kv(qkv, positions, cos, sin, k_cache, v_cache, slots, hq, hkv, **kw):
                d = k_cache.shape[-1]
                return constant(qkv, (qkv.shape[0], hq, d))

            table["rope_write_kv"] = rope_write_kv
        return table

    attention.TritonBackend._ops = ops


if __name__ == "__main__":
    skip = set() if sys.argv[1] == "none" else set(sys.argv[1].split(","))
    unknown = skip - {"norm", "rope"}
    if unknown:
        sys.exit(f"layer_ablation: unknown SKIP {', '.join(sorted(unknown))} (norm, rope)")
    _patch(skip)
    sys.exit(main(sys.argv[2:]))
