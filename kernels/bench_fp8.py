"""FP8 weight GEMV benchmark: ``python -m kernels.bench_fp8 [--sweep] [--json FILE]``.

Llama-3-8B linear shapes (N, K) at M in {1, 8}: ``kernels.gemv.linear_small_m`` on the bf16
weight, on its float8 e4m3 copy with per-channel scales and with 128x128 block scales (the
heuristic's tile each, ``gemv_config``), with ``bench_gemv``'s method: each config checked
against float64 math on the weight it reads, then timed under CUDA-graph replay, one graph of
>= 20 calls rotating over weight copies of >= 256 MB (5x the 50 MB L2), median of 10 replays.
GB/s counts the bytes one call reads and writes (weight, scales, x, out); the device-to-device
copy bandwidth (read + write) measured in the same run is the 100% line. ``--sweep`` times the
fp8 layouts over more tiles and K splits too, at M <= 8 each with and without ``diag`` (tuning:
the best and the heuristic's pick per point; ``--shapes``/``--layouts``/``--ms`` narrow it).
A config prints as (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, diag).
With ``TRITON_INTERPRET=1`` it runs on the CPU at toy sizes (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from kernels.bench import SMOKE, graph_time
from kernels.bench_gemv import DEV, DT, SHAPES, finish, pick, rel_err, run, start
from kernels.gemv import split_k_for
from kernels.quant import dequantize, quantize_blocks, quantize_per_channel

MS = (1, 8)
CALLS = 20
ROTATE_BYTES = 256 << 20
MAX_ERR = 2e-2  # bf16 output against the float64 product with the same (dequantized) weight
LAYOUTS = {"bf16": None, "fp8-channel": quantize_per_channel, "fp8-block": quantize_blocks}
W_SCALE = {"bf16": 0, "fp8-channel": 1, "fp8-block": 2}
# --sweep: (BLOCK_N, BLOCK_K, num_warps, num_stages) for fp8 weights (every M takes tl.dot with
# f16 operands), each at the splits of ``_splits`` (128x128 block scales: BLOCK_N <= 128, all
# here). Under 4 warps tl.dot is mma.sync (64 rows a warp share x's fragments), from 4 warps and
# 64 rows wgmma (tests/sm90_compile.py: instructions per byte).
_SWEEP = [
    (128, 128, 2, 4), (128, 256, 2, 3), (64, 256, 2, 4), (64, 128, 2, 6), (64, 256, 1, 3),
    (32, 256, 1, 4), (64, 256, 4, 4), (64, 256, 4, 3), (64, 512, 4, 3), (64, 128, 4, 6),
    (128, 128, 8, 4), (128, 256, 8, 3), (16, 256, 1, 6), (32, 256, 2, 4), (32, 128, 1, 6),
    (16, 512, 1, 4),
]  # fmt: skip
SPLITS = (2, 4)


def weights(layout: str, n: int, k: int, copies: int) -> list[tuple[torch.Tensor, ...]]:
    """``copies`` (weight, scale or None) pairs of one layout; quantized one copy at a time."""
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, device=DEV, dtype=DT) * 0.02
        out.append((w, None) if LAYOUTS[layout] is None else LAYOUTS[layout](w))
    return out


def nbytes(m: int, n: int, k: int, w: torch.Tensor, s: torch.Tensor | None) -> int:
    scale = 0 if s is None else s.numel() * s.element_size()
    return w.numel() * w.element_size() + scale + (m * k + m * n) * DT.itemsize


def _splits(n: int, k: int, bn: int, bk: int, sms: int) -> list[int]:
    """Unsplit and the heuristic's split; SPLITS too where the N tiles are under one per SM."""
    few = math.ceil(n / bn) < sms
    splits = (1, split_k_for(n, k, bn, bk, sms), *(SPLITS if few else ()))
    return [s for s in dict.fromkeys(splits) if s * bk <= k]


def configs(layout: str, m: int, n: int, k: int, sms: int, sweep: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, diag): the heuristic's pick first
    (``bench_gemv.pick``); with ``sweep`` the fp8 tiles at their splits, each at M <= 8 with
    diag 1 too (``linear_small_m(diag=True)``, BLOCK_K >= 128)."""
    picked = pick(m, n, k, sms, W_SCALE[layout])
    if not sweep or layout == "bf16":
        return [picked]
    more = [(bn, bk, s, w, st, 0) for bn, bk, w, st in _SWEEP
            for s in _splits(n, k, bn, bk, sms)]  # fmt: skip
    if m <= 8:
        more = [(*c0[:5], d) for c0 in [picked, *more] for d in (0, 1) if d == 0 or c0[1] >= 128]
    return [picked] + [c for c in dict.fromkeys(more) if c != picked]


def bench_point(layout: str, name: str, n: int, k: int, sms: int, copy_gbs: float,
                sweep: bool, ms: tuple[int, ...] = MS) -> list[dict]:  # fmt: skip
    one = nbytes(1, n, k, *weights(layout, n, k, 1)[0])
    copies = 1 if SMOKE else max(2, math.ceil(ROTATE_BYTES / one))
    ws = weights(layout, n, k, copies)
    rows = []
    for m in ms:
        xs = torch.randn(copies, m, k, device=DEV, dtype=DT)
        outs = torch.empty(copies, m, n, device=DEV, dtype=DT)
        w0, s0 = ws[0]
        wd = w0.double() if s0 is None else dequantize(w0, s0, torch.float64)
        ref = xs[0].double() @ wd.T
        size = nbytes(m, n, k, w0, s0)
        sets = [(xs[i], w, outs[i], scale) for i, (w, scale) in enumerate(ws)]
        results = []
        for cfg in configs(layout, m, n, k, sms, sweep):
            o = torch.full((m, n), math.nan, device=DEV, dtype=DT)
            err = rel_err(run(xs[0], w0, o, cfg, s0), ref)
            if not err <= MAX_ERR:
                print(f"  {layout} {name} M={m} {cfg}: rel err {err:.2e}: WRONG", flush=True)
                continue
            calls = [lambda s=s, c=cfg: run(*s[:3], c, s[3]) for s in sets]
            results.append((graph_time(calls, min_calls=CALLS), cfg, err))
        picked = pick(m, n, k, sms, W_SCALE[layout])
        pick_us = next((t for t, c, _ in results if c == picked), math.nan)
        results.sort()
        us, cfg, err = results[0]
        row = {"layout": layout, "shape": name, "N": n, "K": k, "M": m, "bytes": size,
               "pick_us": pick_us, "best_us": us, "best_cfg": list(cfg), "rel_err": err,
               "best_gbs": size / us / 1e3, "best_pct_copy": 100 * size / us / 1e3 / copy_gbs,
               "all": [[list(c), round(t, 2)] for t, c, _ in results]}  # fmt: skip
        print("  " + json.dumps({k_: v for k_, v in row.items() if k_ != "all"}), flush=True)
        rows.append(row)
    return rows


def print_table(rows: list[dict], copy_gbs: float) -> None:
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s; us = the heuristic's tile (best of the sweep, "
          "its GB/s and % of copy)")  # fmt: skip
    by = {(r["shape"], r["M"], r["layout"]): r for r in rows}
    print(f"{'shape':8} {'M':>2} | " + " | ".join(f"{lay:>30}" for lay in LAYOUTS)
          + " | fp8-ch/bf16 fp8-blk/bf16")  # fmt: skip
    for shape, m in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        cells, t = [], {}
        for lay in LAYOUTS:
            r = by.get((shape, m, lay))
            if r is None:
                cells.append(f"{'-':>30}")
                continue
            t[lay] = r["pick_us"]
            cells.append(f"{r['pick_us']:7.1f} ({r['best_us']:6.1f} {r['best_gbs']:5.0f} "
                         f"{r['best_pct_copy']:5.1f}%)")  # fmt: skip
        ratio = [t.get(x, math.nan) / t.get("bf16", math.nan) for x in ("fp8-channel", "fp8-block")]
        print(f"{shape:8} {m:2} | " + " | ".join(cells) + f" | {ratio[0]:11.2f} {ratio[1]:12.2f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--sweep", action="store_true", help="time more fp8 tiles (tuning)")
    ap.add_argument("--shapes", default=",".join(s for s in SHAPES if s != "lm_head"),
                    help="comma-separated shape names (kernels.bench_gemv.SHAPES)")  # fmt: skip
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="bf16,fp8-channel,fp8-block")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="batch rows, e.g. 1,8")
    args = ap.parse_args(argv)
    t0, sms, meta, copy_gbs = start()
    rows, ms = [], tuple(int(m) for m in args.ms.split(","))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for layout in args.layouts.split(","):
            rows += bench_point(layout, name, n, k, sms, copy_gbs, args.sweep, ms)
            torch.cuda.empty_cache() if not SMOKE else None
    print_table(rows, copy_gbs)
    finish(t0, meta, copy_gbs, rows, args.json)


if __name__ == "__main__":
    main()
