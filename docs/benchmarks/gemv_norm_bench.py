"""Decode GEMVs with the norm between them folded in, alone: each Llama-3-8B projection at
M = 1 with and without its part (o_proj and down: ``residual=``, the add and the tile sums;
qkv and gate/up: ``norm=``, x times the norm's weight and 1/rms on the sums), bf16 and fp8
per-channel weights, under CUDA-graph replay, weights rotated over copies larger than L2.

    python3 docs/benchmarks/gemv_norm_bench.py [--json FILE] [--no-chain] [--only fp8:o_proj,...]
        [--max-regs N] [--parts 1,512,1024]
    python3 docs/benchmarks/gemv_norm_bench.py --once fp8:o_proj   # for a profiler: three
        eager calls without the fold's part, then three with it (no graph, no timing)
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from kernels.bench import graph_time
from kernels.gemv import linear_small_m
from kernels.quant import quantize_per_channel
from kernels.reference import RowNorm

SHAPES = {  # name: (N, K, act, role)
    "qkv": (6144, 4096, None, "norm"),
    "o_proj": (4096, 4096, None, "residual"),
    "gate_up": (28672, 4096, "silu", "norm"),
    "down": (4096, 14336, None, "residual"),
}
CALLS = 24  # per graph, at least


def time_us(fn, copies: int) -> float:
    """Median µs a call of ``fn(i)`` over the weight copies i, in one CUDA graph
    (``kernels.bench.graph_time``)."""
    return graph_time([functools.partial(fn, i) for i in range(copies)], min_calls=CALLS)


def _calls(x, ws, act, extra, chain, max_regs):
    """A call of the GEMV on weight copy i (in the PDL chain or not)."""
    return lambda i: linear_small_m(x, ws[i][0], weight_scale=ws[i][1], act=act, chain=chain,
                                    max_regs=max_regs, **extra)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument(
        "--once",
        metavar="LAYOUT:SHAPE",
        help="(bf16|fp8):(qkv|o_proj|"
        "gate_up|down): three eager calls plain, three with the part; no timing",
    )
    parser.add_argument(
        "--no-chain",
        action="store_true",
        help="launch each GEMV outside the PDL chain (each waits for the last)",
    )
    parser.add_argument("--only", help="LAYOUT:SHAPE[,...]: time these only")
    parser.add_argument(
        "--max-regs",
        type=int,
        help="ptxas's register cap (0: its own choice; default: kernels.gemv.max_regs_for)",
    )
    parser.add_argument(
        "--parts",
        default="256",
        help="P[,P...]: the normed GEMVs (qkv, gate/up) read P partial sums of squares a row "
        "(the engine's: one per tile of the producer, o_proj's or down's); each P timed",
    )
    args = parser.parse_args()
    parts = [int(p) for p in args.parts.split(",")]
    chain = not args.no_chain
    picked = args.once or args.only  # LAYOUT:SHAPE[,...]
    pick = {tuple(p.split(":")) for p in picked.split(",")} if picked else None
    dev, dt = "cuda", torch.bfloat16
    rows = []
    for layout in ("bf16", "fp8"):
        for name, (n, k, act, role) in SHAPES.items():
            if pick and (layout, name) not in pick:
                continue
            nbytes = n * k * (1 if layout == "fp8" else 2)
            copies = max(2, -(-120_000_000 // nbytes))  # > 2x the 50 MB L2
            ws = []
            for _ in range(copies):
                w = torch.randn(n, k, device=dev) * 0.02
                ws.append(quantize_per_channel(w) if layout == "fp8" else (w.to(dt), None))
            x = torch.randn(1, k, device=dev, dtype=dt)
            res = torch.randn(1, n if act is None else n // 2, device=dev, dtype=dt)
            plain = _calls(x, ws, act, {}, chain, args.max_regs)
            nw = torch.ones(k, device=dev, dtype=dt)
            variants = {None: {"residual": res}}  # parts: None
            if role == "norm":
                variants = {p: {"norm": RowNorm(torch.rand(1, p, device=dev), nw, 1e-5)}
                            for p in parts}  # fmt: skip
            for p, part in variants.items():
                fused = _calls(x, ws, act, part, chain, args.max_regs)
                if args.once:  # the profiler's launches: _linear_kernel 1-3 plain, 4-6 fused
                    for f in (plain, plain, plain, fused, fused, fused):
                        f(0)
                    torch.cuda.synchronize()
                    return
                a, b, a2, b2 = (time_us(f, copies) for f in (plain, fused, plain, fused))
                row = dict(layout=layout, shape=name, role=role, chain=chain,
                           max_regs=args.max_regs, parts=p,
                           plain_us=min(a, a2), fused_us=min(b, b2),
                           gb_s=nbytes / min(a, a2) / 1e3)  # fmt: skip
                rows.append(row)
                what = role if p is None else f"{role} P={p}"
                print(f"{layout:5} {name:8} {what:10} plain {row['plain_us']:7.2f} us  fused "
                      f"{row['fused_us']:7.2f} us  ({row['gb_s']:.0f} GB/s plain)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
