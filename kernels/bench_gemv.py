"""Small-M linear benchmark: ``python -m kernels.bench_gemv [--json FILE] [--wide] [--shapes]``
(``--gated``: the gated MLP's gate_up with its activation, fused against unfused).

Llama-3-8B linear shapes (N, K) at M in {1, 8, 16}, bf16: F.linear (cuBLAS) beside
``kernels.gemv.linear_small_m`` over a sweep of configs (the heuristic's pick among them).
Every config is first checked against F.linear (relative error ``|out - ref| / |ref|``), then
timed under CUDA-graph replay: one graph of >= 20 calls that rotate over weight copies totalling
>= 256 MB (5x the 50 MB L2), median of 10 replays. GB/s counts the weight, x and output bytes
once each; the device-to-device copy bandwidth (bytes read + written) is the 100% line.
The default run takes ~30 s on an H100 (cold Triton cache); ``--wide`` sweeps more configs
(tuning, ~1.5 min); ``--diag`` adds ``linear_small_m(diag=True)`` tiles at M <= 8 (``--ms``
picks the M); ``--shapes qkv_tp8,narrow`` times narrow layers, where K is split. With
``TRITON_INTERPRET=1`` it runs on the CPU at toy sizes (a smoke test of the script only).

``--gated [--scales none,channel,block]``: gate_up of Gemma 3 12B (GELU-tanh), Llama 3 8B and
Qwen3 8B (SiLU) at M = 1 (``GATED_MS``), the weight bf16 or e4m3: the GEMV alone, the GEMV then
the activation kernel (the unfused path), and ``linear_small_m(act=...)`` (fused), each under
CUDA-graph replay over rotated weight copies (>= 256 MB), launched as in the engine's decode
graph (the PDL chain on where the device has it); three alternated rounds, medians.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from kernels import quant
from kernels.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.bench import SMOKE, copy_bandwidth, graph_time, run_meta
from kernels.gemv import _num_sms, gemv_config, linear_small_m, split_k_for

DEV = "cpu" if SMOKE else "cuda"
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter rounds bf16 wrongly
SHAPES = {  # name: (N, K), Llama-3-8B
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
# narrow layers (tensor parallel 8), where the heuristic splits K: --shapes qkv_tp8,narrow;
# a rank's shapes at tensor parallel 2 (half the rows of the column-parallel layers, half the K
# of the row-parallel ones, half the vocabulary): --shapes qkv_tp2,o_proj_tp2,...
EXTRA_SHAPES = {"qkv_tp8": (768, 4096), "narrow": (256, 14336), "qkv_tp2": (3072, 4096),
                "o_proj_tp2": (4096, 2048), "gate_up_tp2": (14336, 4096),
                "down_tp2": (4096, 7168), "lm_head_tp2": (64128, 4096)}  # fmt: skip
if SMOKE:
    SHAPES = {"qkv": (96, 512), "down": (64, 1536)}
    EXTRA_SHAPES = {"narrow": (16, 4096)}
MS = (1, 8, 16)
CALLS = 20  # per graph
ROTATE_BYTES = 256 << 20  # weight copies per shape: at least this many bytes (and 2 copies)
MAX_ERR = 2e-2  # bf16 output: ~4e-3 from rounding alone

# (BLOCK_N, BLOCK_K, num_warps, num_stages), each at split_k_for's SPLIT_K and at 1 and 2 splits;
# the fastest of a 47-config sweep (--wide) at each point are among them.
_TILES_M1 = [(8, 1024, 4, 3), (8, 1024, 4, 4), (8, 512, 4, 4), (4, 1024, 4, 4), (16, 512, 4, 3),
             (8, 2048, 8, 3), (16, 256, 4, 4), (4, 2048, 4, 3)]  # fmt: skip
_TILES_DOT = [(64, 256, 4, 3), (64, 128, 4, 4), (32, 256, 4, 4), (32, 128, 4, 5), (16, 256, 4, 5),
              (32, 512, 4, 2), (128, 128, 4, 3), (16, 256, 4, 4)]  # fmt: skip
_WIDE_M1 = [(8, 1024, 8, 3), (4, 2048, 4, 3), (16, 1024, 4, 3), (16, 1024, 8, 3), (32, 512, 8, 3),
            (16, 512, 4, 2), (8, 512, 4, 3), (4, 512, 4, 4), (8, 256, 4, 4)]  # fmt: skip
_WIDE_DOT = [(16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (64, 128, 4, 3),
             (32, 512, 8, 3), (64, 64, 4, 6), (128, 64, 4, 4), (128, 256, 8, 3)]  # fmt: skip


# --diag (``linear_small_m(diag=True)``, M <= 8): one- and two-warp mma.sync tiles and the
# 4-warp wgmma one, at splits 1, 2, 4 and the heuristic's (sm_90 compile reports, SASS per
# weight byte at M = 1: 0.38-0.45, against 1.97 for the elementwise loop; M = 8: 0.42 against
# 0.90 for (64, 256, 4, 3))
_DIAG_TILES = [(16, 256, 1, 6), (32, 256, 1, 4), (32, 128, 1, 6), (64, 256, 2, 4),
               (64, 256, 4, 3), (16, 512, 1, 4)]  # fmt: skip


def candidates(m: int, n: int, k: int, sms: int, wide: bool, diag: bool = False) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, diag): the heuristic's pick first,
    then each tile at its heuristic split, unsplit and split 2; with ``diag`` (M <= 8) the
    ``_DIAG_TILES`` with diag at splits 1, 2, 4 and the heuristic's too."""
    tiles = (_TILES_M1 + _WIDE_M1 * wide) if m == 1 else (_TILES_DOT + _WIDE_DOT * wide)
    if SMOKE:
        tiles = tiles[:2]
    out = [pick(m, n, k, sms)]
    for bn, bk, w, st in tiles:
        for split in dict.fromkeys((split_k_for(n, k, bn, bk, sms), 1, 2)):
            if (bn, bk, split, w, st, 0) not in out and split <= max(1, k // bk):
                out.append((bn, bk, split, w, st, 0))
    for bn, bk, w, st in _DIAG_TILES[: 2 if SMOKE else None] if diag and m <= 8 else ():
        for split in dict.fromkeys((split_k_for(n, k, bn, bk, sms), 1, 2, 4)):
            if split <= max(1, k // bk):
                out.append((bn, bk, split, w, st, 1))
    return out


def pick(m: int, n: int, k: int, sms: int, w_scale: int = 0) -> tuple:
    """The heuristic's (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, diag), as
    ``linear_small_m`` takes them by default (kernels.bench_fp8 too)."""
    *cfg, diag = gemv_config(m, n, k, sms, w_scale)
    return (*cfg, int(diag))


def run(x, w, out, cfg: tuple, scale=None) -> torch.Tensor:
    """``linear_small_m`` at a ``candidates`` (or bench_fp8 ``configs``) entry."""
    return linear_small_m(x, w, out=out, weight_scale=scale, config=cfg[:5], diag=bool(cfg[5]))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def bench_shape(name: str, n: int, k: int, sms: int, copy_gbs: float, wide: bool,
                diag: bool = False, ms: tuple[int, ...] = MS) -> list[dict]:  # fmt: skip
    """All M for one weight shape: the weight copies are allocated once."""
    wbytes = n * k * DT.itemsize
    copies = 1 if SMOKE else max(2, math.ceil(ROTATE_BYTES / wbytes))
    ws = torch.randn(copies, n, k, device=DEV, dtype=DT)
    rows = []
    for m in ms:
        xs = torch.randn(copies, m, k, device=DEV, dtype=DT)
        outs = torch.empty(copies, m, n, device=DEV, dtype=DT)
        gbs = lambda us, m=m: (wbytes + (m * k + m * n) * DT.itemsize) / us / 1e3  # noqa: E731
        ref = F.linear(xs[0], ws[0])
        sets = [(xs[i], ws[i], outs[i]) for i in range(copies)]
        t_lin = graph_time([lambda s=s: F.linear(s[0], s[1], out=s[2]) for s in sets], CALLS)
        picked = pick(m, n, k, sms)
        results, worst = [], 0.0
        for cfg in candidates(m, n, k, sms, wide, diag):
            o = torch.full((m, n), math.nan, device=DEV, dtype=DT)
            err = rel_err(run(xs[0], ws[0], o, cfg), ref)
            worst = max(worst, err)
            if not err <= MAX_ERR:
                print(f"  {name} M={m} {cfg}: rel err {err:.2e} > {MAX_ERR}: WRONG", flush=True)
                continue
            calls = [lambda s=s, c=cfg: run(*s, c) for s in sets]
            results.append((graph_time(calls, min_calls=CALLS), cfg))
        results.sort()
        t_pick = next((t for t, c in results if c == picked), math.nan)
        row = {
            "shape": name, "N": n, "K": k, "M": m,
            "linear_us": t_lin, "linear_gbs": gbs(t_lin),
            "best_cfg": list(results[0][1]), "best_us": results[0][0],
            "best_gbs": gbs(results[0][0]), "best_pct_copy": 100 * gbs(results[0][0]) / copy_gbs,
            "pick_cfg": list(picked), "pick_us": t_pick, "pick_gbs": gbs(t_pick),
            "max_rel_err": worst, "configs": len(results),
            "all": [[list(c), round(t, 2)] for t, c in results],
        }  # fmt: skip
        print("  " + json.dumps({k_: v for k_, v in row.items() if k_ != "all"}), flush=True)
        if wide:
            print("    " + " ".join(f"{tuple(c)}:{t}" for c, t in row["all"]), flush=True)
        rows.append(row)
    return rows


def print_table(rows: list[dict], copy_gbs: float) -> None:
    print(f"\ncopy bandwidth {copy_gbs:.0f} GB/s (read + write); GB/s = weight+x+out bytes / time")
    print(f"{'shape':8} {'M':>2} | {'F.linear':>8} {'GB/s':>5} | {'best':>7} {'GB/s':>5} "
          f"{'%copy':>5} {'config (BN, BK, S, w, st, diag)':29} | {'pick':>7} {'GB/s':>5} | "
          f"{'err':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['shape']:8} {r['M']:2} | {r['linear_us']:8.1f} {r['linear_gbs']:5.0f} | "
              f"{r['best_us']:7.1f} {r['best_gbs']:5.0f} {r['best_pct_copy']:5.1f} "
              f"{str(tuple(r['best_cfg'])):29} | {r['pick_us']:7.1f} {r['pick_gbs']:5.0f} | "
              f"{r['max_rel_err']:7.1e}")  # fmt: skip


def start() -> tuple[float, int, dict, float]:
    """A run's start: (its clock, the SM count, the run's metadata, the copy bandwidth in GB/s),
    the metadata and the bandwidth printed (kernels.bench_gemv and kernels.bench_fp8)."""
    t0 = time.perf_counter()
    sms = _num_sms(torch.device(DEV))
    meta = {**run_meta(), "sms": sms}
    print(json.dumps(meta), flush=True)
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    return t0, sms, meta, copy_gbs


def finish(t0: float, meta: dict, copy_gbs: float, rows: list[dict], path: str | None) -> None:
    """The run's time, and every row in ``path`` as JSON when given."""
    print(f"total {time.perf_counter() - t0:.0f} s")
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, "copy_gbs": copy_gbs, "rows": rows}, f, indent=1)


# gate_up [2I, K] and the activation of each model's MLP
GATED_SHAPES = {
    "gemma3-12b": (30720, 3840, "gelu_tanh"),
    "llama3-8b": (28672, 4096, "silu"),
    "qwen3-8b": (24576, 4096, "silu"),
}
if SMOKE:
    GATED_SHAPES = {"gemma3-toy": (192, 384, "gelu_tanh"), "llama3-toy": (128, 256, "silu")}
GATED_MS = (1,)
GATED_ROUNDS = 3
_ACT = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def bench_gated(name: str, n: int, k: int, act: str, scales: str, copy_gbs: float) -> list[dict]:
    """Fused (``linear_small_m(act=act)``) against unfused (the GEMV, then the activation
    kernel) and the GEMV alone, for gate_up [n, k] (``scales``: none, channel or block)."""
    wdt = DT if scales == "none" else torch.float8_e4m3fn
    wbytes = n * k * wdt.itemsize
    copies = 1 if SMOKE else max(2, math.ceil(ROTATE_BYTES / wbytes))
    ws, ss = [], []
    for _ in range(copies):
        w = torch.randn(n, k, device=DEV, dtype=DT) / k**0.5
        if scales != "none":
            w, s = (quant.quantize_per_channel if scales == "channel" else quant.quantize_blocks)(w)
            ss.append(s)
        ws.append(w)
    ss = ss or [None] * copies
    rows = []
    for m in GATED_MS:
        xs = [torch.randn(m, k, device=DEV, dtype=DT) for _ in range(copies)]
        mids = [torch.empty(m, n, device=DEV, dtype=DT) for _ in range(copies)]
        outs = [torch.empty(m, n // 2, device=DEV, dtype=DT) for _ in range(copies)]
        sets = list(zip(xs, ws, ss, mids, outs, strict=True))

        def gemv(s):
            return linear_small_m(s[0], s[1], out=s[3], weight_scale=s[2])

        def unfused(s):
            return _ACT[act](gemv(s))

        def fused(s):
            return linear_small_m(s[0], s[1], out=s[4], weight_scale=s[2], act=act)

        err = rel_err(fused(sets[0]), unfused(sets[0]))
        cases = {"gemv": gemv, "unfused": unfused, "fused": fused}
        times = {c: [] for c in cases}
        for _ in range(1 if SMOKE else GATED_ROUNDS):  # alternated: drift hits all alike
            for c, fn in cases.items():
                times[c].append(graph_time([lambda s=s, fn=fn: fn(s) for s in sets], CALLS))
        t = {c: sorted(v)[len(v) // 2] for c, v in times.items()}
        gbs = (wbytes + (m * k + m * n // 2) * DT.itemsize) / t["fused"] / 1e3
        row = {
            "shape": name, "N": n, "K": k, "act": act, "scales": scales, "M": m,
            "config": list(gemv_config(m, n, k, _num_sms(torch.device(DEV)),
                                       0 if scales == "none" else 1 + (scales == "block"))),
            "gemv_us": t["gemv"], "unfused_us": t["unfused"], "fused_us": t["fused"],
            "saved_us": t["unfused"] - t["fused"], "fused_gbs": gbs,
            "fused_pct_copy": 100 * gbs / copy_gbs, "fused_vs_unfused_rel_err": err,
            "rounds": {c: [round(x, 2) for x in v] for c, v in times.items()},
        }  # fmt: skip
        print("  " + json.dumps(row), flush=True)
        rows.append(row)
    return rows


def print_gated(rows: list[dict]) -> None:
    print(f"\n{'shape':11} {'scales':7} {'M':>2} | {'gemv':>7} {'unfused':>7} {'fused':>7} "
          f"{'saved':>6} | {'GB/s':>5} {'%copy':>5} | {'err':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['shape']:11} {r['scales']:7} {r['M']:2} | {r['gemv_us']:7.2f} "
              f"{r['unfused_us']:7.2f} {r['fused_us']:7.2f} {r['saved_us']:6.2f} | "
              f"{r['fused_gbs']:5.0f} {r['fused_pct_copy']:5.1f} | "
              f"{r['fused_vs_unfused_rel_err']:7.1e}")  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--wide", action="store_true", help="sweep more configs (tuning)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names")
    ap.add_argument("--diag", action="store_true", help="time diag tiles too (M <= 8)")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="batch rows, e.g. 1,8")
    ap.add_argument(
        "--gated",
        action="store_true",
        help="gate_up fused with its activation vs unfused (GATED_SHAPES)",
    )
    ap.add_argument(
        "--scales",
        default="none",
        help="--gated: weights, comma-separated: none (bf16), channel, block (e4m3)",
    )
    args = ap.parse_args(argv)
    t0, sms, meta, copy_gbs = start()
    if args.gated:
        rows = []
        for name in (args.shapes or ",".join(GATED_SHAPES)).split(","):
            for scales in args.scales.split(","):
                rows += bench_gated(name, *GATED_SHAPES[name], scales, copy_gbs)
                torch.cuda.empty_cache() if not SMOKE else None
        print_gated(rows)
        finish(t0, meta, copy_gbs, rows, args.json)
        return
    args.shapes = args.shapes or ",".join(SHAPES)
    rows, ms = [], tuple(int(m) for m in args.ms.split(","))
    for name in args.shapes.split(","):
        n, k = {**SHAPES, **EXTRA_SHAPES}[name]
        rows += bench_shape(name, n, k, sms, copy_gbs, args.wide, args.diag, ms)
        torch.cuda.empty_cache() if not SMOKE else None
    print_table(rows, copy_gbs)
    finish(t0, meta, copy_gbs, rows, args.json)


if __name__ == "__main__":
    main()
