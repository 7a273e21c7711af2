"""What bounds the M = 1 float8 GEMV: each Llama-3-8B projection's e4m3 weight read by kernels
that do next to no math, on the engine's grid and on others, by pointers (``cp.async``) and by
tensor descriptors (TMA), against the engine's GEMV on the same bytes; and a GEMV whose weight
tiles come by TMA (a measurement prototype for the GPU, not production code; nothing here gates
CI).

    python3 docs/benchmarks/gemv_ceiling.py --json OUT.json      # the GPU run
    python3 docs/benchmarks/gemv_ceiling.py --sm90-report         # no GPU: compile for sm_90

Issue 15's fp8 weights + cache stay at 72-85% of their roofline, and the step's GEMVs stream
at 82-84% of the copy bandwidth where bf16's stream at 93-96% (``fp8.md``, sessions 19 and
37). Per projection (session 16) the loss against the copy rate is 2.8-4.4 µs a launch and
grows with the weight's size, so it is not only a launch's fixed cost. The kernels here tell
the parts apart:

- ``read``: each program xors its rows' weight words together (one ``xor`` a 4-byte word, the
  result stored so that nothing is left out), tiles ``(BLOCK_N rows, BLOCK_K bytes, warps,
  stages)`` walked as the engine's tiles walk them (``tl.range`` with ``num_stages``): the
  time a read of those bytes takes on that grid with almost no instructions.
- ``read-tma``: the same, each tile one bulk tensor copy (``TensorDescriptor``) where the
  pointer tiles take one ``cp.async`` of 16 bytes a thread each.
- ``gemv-tma``: the engine's M = 1 ``diag`` dot (``kernels.gemv``: e4m3 widened to f16, x in f16
  as 8 chunks side by side, the weight tile seen as 8x the rows, ``tl.dot``), its weight tiles
  by TMA; per-channel scales, no epilogue beyond the scale. Checked against float64 first.
- ``engine``: ``kernels.gemv.linear_small_m`` at its own pick (``gemv_config``).

Timing: ``kernels.bench.graph_time`` (one CUDA graph of >= 20 calls rotating over weight copies
of >= 256 MB, 5x the L2; median of 10 replays), every variant of a shape in one process, the
shapes' rounds alternated (``--rounds``); the copy bandwidth (read + write) measured in the
same run is the 100% line, and ``big-read`` (the ``read`` kernel over 1 GB) gives a pure read's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kernels.bench import DEV, SMOKE, copy_bandwidth, graph_time, run_meta  # noqa: E402
from kernels.common import pdl_enter, pdl_kwargs  # noqa: E402
from kernels.gemv import gemv_config, linear_small_m  # noqa: E402
from kernels.quant import quantize_per_channel  # noqa: E402

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # Triton < 3.4: no TMA variants
    TensorDescriptor = None

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip
ROTATE_BYTES = 256 << 20
if SMOKE:  # TRITON_INTERPRET=1: toy shapes on the CPU, a check of the script only
    SHAPES = {"qkv": (96, 512), "o_proj": (64, 512), "gate_up": (128, 512), "down": (64, 1024)}
    ROTATE_BYTES = 1
CALLS = 20
# (BLOCK_N, BLOCK_K bytes, warps, stages): the engine's one-warp 16-row diag tile first, then
# more warps a program over the same rows per SM, and wider tiles
READ_TILES = [(16, 256, 1, 6), (16, 512, 1, 4), (32, 256, 1, 6), (64, 256, 4, 4),
              (32, 512, 4, 4), (16, 1024, 4, 3), (128, 128, 2, 4), (8, 512, 1, 6)]  # fmt: skip
# the engine's kernel at other one-warp diag tiles (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages):
# deeper pipelines, shorter and longer K steps, K split in 2 and 4 (more programs an SM;
# kernels.gemv takes BLOCK_N >= 16 on tl.dot)
ENGINE_TILES = [(16, 256, 1, 1, 8), (16, 128, 1, 1, 8), (16, 512, 1, 1, 4), (16, 256, 1, 1, 6),
                (32, 256, 1, 1, 6), (16, 256, 2, 1, 6), (16, 256, 4, 1, 6)]  # fmt: skip
GEMV_TMA_TILES = [(16, 256, 1, 6), (16, 256, 1, 8), (32, 256, 1, 6), (16, 512, 1, 4),
                  (64, 256, 4, 4), (128, 128, 2, 4)]  # fmt: skip


@triton.jit
def _read_kernel(W, Out, K4, BLOCK_N: tl.constexpr, BK4: tl.constexpr, STAGES: tl.constexpr,
                 CHAIN: tl.constexpr = False):  # fmt: skip
    """Out[p] = the xor of W's int32 words [p BLOCK_N : (p + 1) BLOCK_N, :] (W [N, K4]).
    CHAIN: in the PDL chain as the engine's kernels are (``kernels.common.pdl_enter``)."""
    pdl_enter(CHAIN)
    pid = tl.program_id(0)
    rows = (pid * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ptrs = W + rows[:, None] * K4 + tl.arange(0, BK4)[None, :]
    acc = tl.zeros([BLOCK_N, BK4], tl.int32)
    for _ in tl.range(0, K4, BK4, num_stages=STAGES):
        acc ^= tl.load(ptrs, eviction_policy="evict_first")
        ptrs += BK4
    tl.store(Out + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _read_tma_kernel(desc, Out, K4, BLOCK_N: tl.constexpr, BK4: tl.constexpr,
                     STAGES: tl.constexpr):  # fmt: skip
    """``_read_kernel`` with each [BLOCK_N, BK4] tile one bulk copy through ``desc``."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK_N, BK4], tl.int32)
    for k in tl.range(0, K4, BK4, num_stages=STAGES):
        acc ^= desc.load([pid * BLOCK_N, k])
    tl.store(Out + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0))


@triton.jit
def _gemv_tma_kernel(desc, X, S, Out, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     STAGES: tl.constexpr):  # fmt: skip
    """out[n] = S[n] sum_k W[n, k] x[k] for one bf16 row x, e4m3 W [N, K] by ``desc`` tiles:
    ``kernels.gemv``'s diag dot at M = 1 (G = 8 chunks of x's K step as the dot's 8 columns,
    the weight tile [BN, BK] seen as [8 BN, BK / 8], the diagonal kept at the end)."""
    G: tl.constexpr = 8
    pid = tl.program_id(0)
    cols = tl.arange(0, G)
    offs_x = (cols * (BLOCK_K // G))[None, :] + tl.arange(0, BLOCK_K // G)[:, None]  # [BK/8, 8]
    x_ptrs = X + offs_x
    acc = tl.zeros([BLOCK_N * G, G], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        w = desc.load([pid * BLOCK_N, k])  # [BN, BK] e4m3
        x = tl.load(x_ptrs + k, eviction_policy="evict_last").to(tl.float16)
        w = tl.reshape(w.to(tl.float16), [BLOCK_N * G, BLOCK_K // G])
        acc = tl.dot(w, x, acc)
    acc = tl.reshape(acc, [BLOCK_N, G, 1, G])
    eye = tl.arange(0, G)[:, None] == tl.arange(0, G)[None, :]
    acc = tl.sum(tl.sum(tl.where(eye[None, :, None, :], acc, 0.0), 3), 1)  # [BN, 1]
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.reshape(acc, [BLOCK_N]) * tl.load(S + rows)
    tl.store(Out + rows, out.to(Out.dtype.element_ty))


def read(w32: torch.Tensor, out: torch.Tensor, tile: tuple, chain: bool = False) -> torch.Tensor:
    bn, bk, warps, stages = tile
    n, k4 = w32.shape
    _read_kernel[(n // bn,)](w32, out, k4, BLOCK_N=bn, BK4=bk // 4, STAGES=stages,
                             num_warps=warps, **pdl_kwargs(w32.device, chain))  # fmt: skip
    return out


def read_desc(w32: torch.Tensor, tile: tuple):
    bn, bk = tile[:2]
    return TensorDescriptor(w32, list(w32.shape), [w32.shape[1], 1], [bn, bk // 4])


def read_tma(desc, n: int, k4: int, out: torch.Tensor, tile: tuple) -> torch.Tensor:
    bn, bk, warps, stages = tile
    _read_tma_kernel[(n // bn,)](desc, out, k4, BLOCK_N=bn, BK4=bk // 4, STAGES=stages,
                                 num_warps=warps)  # fmt: skip
    return out


def gemv_desc(w: torch.Tensor, tile: tuple):
    return TensorDescriptor(w, list(w.shape), [w.shape[1], 1], list(tile[:2]))


def gemv_tma(desc, x, s, out, n: int, k: int, tile: tuple) -> torch.Tensor:
    bn, bk, warps, stages = tile
    _gemv_tma_kernel[(n // bn,)](desc, x, s, out, k, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages,
                                 num_warps=warps)  # fmt: skip
    return out


def xor_ref(w32: torch.Tensor, bn: int) -> torch.Tensor:
    """Each BLOCK_N rows' xor, on the CPU (numpy's bitwise_xor.reduce)."""
    import numpy as np

    a = w32.cpu().numpy().reshape(w32.shape[0] // bn, -1)
    return torch.from_numpy(np.bitwise_xor.reduce(a, axis=1))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return ((out.double() - ref).norm() / ref.norm()).item()


def shape_calls(name: str, dev: str, variants: set) -> tuple[dict, dict]:
    """Every variant of one shape (``SHAPES[name]``) as a list of calls over the rotated weight
    copies, each checked first: ({label: calls}, {label: error or mismatch})."""
    n, k = SHAPES[name]
    copies = max(2, math.ceil(ROTATE_BYTES / (n * k)))
    ws, ss = [], []
    for _ in range(copies):  # quantized one copy at a time
        q, s = quantize_per_channel(torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02)
        ws.append(q)
        ss.append(s)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    ref = (ws[0].double() * ss[0].double()[:, None]) @ x[0].double()
    calls, checks = {}, {}
    if "engine" in variants:
        out = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
        sms = 132 if SMOKE else torch.cuda.get_device_properties(dev).multi_processor_count
        cfg = gemv_config(1, n, k, sms, 1)
        label = f"engine {tuple(int(c) for c in cfg)}"
        checks[label] = rel_err(linear_small_m(x, ws[0], out=out, weight_scale=ss[0])[0], ref)
        calls[label] = [lambda w=w, s=s, o=out: linear_small_m(x, w, out=o, weight_scale=s)
                        for w, s in zip(ws, ss)]  # fmt: skip
        for cfg in ENGINE_TILES:
            if n % cfg[0] or k % cfg[1]:
                continue
            label = f"engine {cfg}"
            run = lambda w, s, o, c=cfg: linear_small_m(x, w, out=o, weight_scale=s,  # noqa: E731
                                                        config=c, diag=True)  # fmt: skip
            checks[label] = rel_err(run(ws[0], ss[0], out)[0], ref)
            calls[label] = [lambda w=w, s=s, o=out, r=run: r(w, s, o) for w, s in zip(ws, ss)]
    w32s = [w.view(torch.int32) for w in ws]
    for tile in READ_TILES:
        bn, bk = tile[:2]
        if n % bn or k % bk:
            continue
        out = torch.empty(n // bn, device=dev, dtype=torch.int32)
        want = xor_ref(w32s[0], bn)
        for chain in (False, True):
            kind = "read-pdl" if chain else "read"
            if kind not in variants:
                continue
            label = f"{kind} {tile}"
            checks[label] = int((read(w32s[0], out, tile, chain).cpu() != want).sum())
            calls[label] = [lambda w=w, t=tile, o=out, c=chain: read(w, o, t, c) for w in w32s]
        if "read-tma" in variants and TensorDescriptor is not None:
            label = f"read-tma {tile}"
            descs = [read_desc(w, tile) for w in w32s]
            checks[label] = int((read_tma(descs[0], n, k // 4, out, tile).cpu() != want).sum())
            calls[label] = [lambda d=d, t=tile, o=out: read_tma(d, n, k // 4, o, t)
                              for d in descs]  # fmt: skip
    if "gemv-tma" in variants and TensorDescriptor is not None:
        for tile in GEMV_TMA_TILES:
            bn, bk = tile[:2]
            if n % bn or k % bk:
                continue
            out = torch.empty(n, device=dev, dtype=torch.bfloat16)
            descs = [gemv_desc(w, tile) for w in ws]
            label = f"gemv-tma {tile}"
            checks[label] = rel_err(gemv_tma(descs[0], x, ss[0], out, n, k, tile), ref)
            calls[label] = [lambda d=d, s=s, t=tile, o=out: gemv_tma(d, x, s, o, n, k, t)
                            for d, s in zip(descs, ss)]  # fmt: skip
    return calls, checks


# --layer: a decode layer's four projections in order, as one sequence of launches (each
# projection's copies rotated), the engine's GEMVs against reads on the engine's grid and on
# the best read tiles of the per-shape run, each without and with the PDL chain
LAYER = ("qkv", "o_proj", "gate_up", "down")
LAYER_READ_TILES = {
    "engine's grid": {name: (16, 256, 1, 6) for name in LAYER},
    "best tiles": {"qkv": (8, 512, 1, 6), "o_proj": (8, 512, 1, 6), "gate_up": (16, 1024, 4, 3),
                   "down": (8, 512, 1, 6)},
}  # fmt: skip
if SMOKE:
    LAYER_READ_TILES = {"toy": {name: (16, 256, 1, 2) for name in LAYER}}


def layer_calls(dev: str, copies: int = 2) -> dict:
    """{label: calls}: ``copies`` layers' projections, each a sequence qkv, o_proj, gate_up,
    down (the kernels checked per shape before)."""
    ws = {name: [quantize_per_channel(torch.randn(*SHAPES[name], device=dev,
                                                  dtype=torch.bfloat16) * 0.02)
                 for _ in range(copies)] for name in LAYER}  # fmt: skip
    xs = {m: torch.randn(1, SHAPES[m][1], device=dev, dtype=torch.bfloat16) for m in LAYER}
    outs = {m: torch.empty(1, SHAPES[m][0], device=dev, dtype=torch.bfloat16) for m in LAYER}
    calls = {"engine": [lambda x=xs[m], q=ws[m][c][0], s=ws[m][c][1], o=outs[m]:
                        linear_small_m(x, q, out=o, weight_scale=s)
                        for c in range(copies) for m in LAYER]}  # fmt: skip
    for label, tiles in LAYER_READ_TILES.items():
        for chain in (False, True):
            seq = []
            for c in range(copies):
                for m in LAYER:
                    w32 = ws[m][c][0].view(torch.int32)
                    o = torch.empty(SHAPES[m][0] // tiles[m][0], device=dev, dtype=torch.int32)
                    seq.append(lambda w=w32, o=o, t=tiles[m], ch=chain: read(w, o, t, ch))
            calls[f"read{'-pdl' if chain else ''}, {label}"] = seq
    return calls


def time_layer(dev: str, rounds: int, copy: float) -> list[dict]:
    """µs a layer (4 launches) of each ``layer_calls`` variant, rounds alternated."""
    calls = layer_calls(dev)
    times: dict = {}
    for r in range(rounds):
        for label in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            us = graph_time(calls[label], min_calls=2 * len(calls[label]))
            times.setdefault(label, []).append(len(LAYER) * us)
    ideal = sum(SHAPES[m][0] * SHAPES[m][1] for m in LAYER) / copy / 1e3
    return [result_row("layer", label, ts, ideal, "per shape") for label, ts in times.items()]


def result_row(shape: str, label: str, ts: list, ideal: float, check) -> dict:
    """One JSON row: the median of a variant's rounds (µs) against ``ideal`` (the copy rate's)."""
    us = statistics.median(ts)
    return {"shape": shape, "variant": label, "us": round(us, 2),
            "rounds": [round(t, 2) for t in ts], "ideal_us": round(ideal, 2),
            "pct_copy": round(100 * ideal / us, 1), "check": check}  # fmt: skip


def bench(args) -> None:
    dev = DEV
    t0 = time.perf_counter()
    meta = run_meta()
    print(json.dumps(meta), flush=True)
    copy = copy_bandwidth()
    big_rows = 1 << (5 if SMOKE else 14)  # 1 GB: 16,384 rows of 64 KB
    big = torch.randint(-(2**31), 2**31 - 1, (big_rows, 1 << 14), device=dev, dtype=torch.int32)
    big_out = torch.empty(big.shape[0] // 16, device=dev, dtype=torch.int32)
    big_us = graph_time([lambda b=big, o=big_out: read(b, o, (16, 1024, 4, 3))], min_calls=4)
    big_gbs = big.numel() * 4 / big_us / 1e3
    print(
        f"copy {copy:.0f} GB/s; read of 1 GB {big_gbs:.0f} GB/s "
        f"({100 * big_gbs / copy:.1f}% of copy)",
        flush=True,
    )
    del big, big_out
    variants = set(args.variants.split(","))
    shapes = [s for s in args.shapes.split(",")]
    times: dict = {}
    errors: dict = {}
    for r in range(args.rounds):
        for name in shapes if r % 2 == 0 else shapes[::-1]:
            calls, checks = shape_calls(name, dev, variants)
            for label, fns in calls.items():
                err = checks[label]
                errors.setdefault(name, {})[label] = err
                if not (err <= 2e-2 if isinstance(err, float) else err == 0):
                    print(f"  {name} {label}: WRONG ({err})", flush=True)
                    continue
                us = graph_time(fns, min_calls=CALLS)
                times.setdefault(name, {}).setdefault(label, []).append(us)
            del calls
            torch.cuda.empty_cache()
            print(f"round {r} {name} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        ideal = n * k / copy / 1e3  # µs at the copy rate
        for label, ts in times.get(name, {}).items():
            rows.append(result_row(name, label, ts, ideal, errors[name][label]))
    if args.layer:
        rows += time_layer(dev, args.rounds, copy)
    print(
        f"\ncopy {copy:.0f} GB/s, a pure read of 1 GB {big_gbs:.0f} GB/s; µs (% of copy), "
        f"medians of {args.rounds} rounds"
    )
    for row in rows:
        print(
            f"{row['shape']:8} {row['variant']:34} {row['us']:7.2f} ({row['pct_copy']:5.1f}%)"
            f"  ideal {row['ideal_us']:.2f}"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"meta": meta, "copy_gbs": copy, "read_1gb_gbs": big_gbs, "rows": rows}, f, indent=1
            )


def sm90_report() -> None:
    """Compile the read and TMA kernels for sm_90 (no GPU): registers, shared memory, the loop's
    SASS per weight byte a thread, and whether bulk copies came out."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "tests"))  # fmt: skip
    from sm90_compile import _compile, loop_mix, resources  # tests/sm90_compile.py

    for tile in READ_TILES[:3] + GEMV_TMA_TILES[:2]:
        bn, bk, warps, stages = tile
        for kind in ("read", "read-tma", "gemv-tma"):
            if kind == "read":
                jit, ptrs = _read_kernel, {"W": "*i32", "Out": "*i32"}
                consts = {"BLOCK_N": bn, "BK4": bk // 4, "STAGES": stages}
            elif kind == "read-tma":
                jit = _read_tma_kernel
                ptrs = {"desc": f"tensordesc<i32[{bn}, {bk // 4}]>", "Out": "*i32"}
                consts = {"BLOCK_N": bn, "BK4": bk // 4, "STAGES": stages}
            else:
                jit = _gemv_tma_kernel
                ptrs = {"desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>", "X": "*bf16", "S": "*fp32",
                        "Out": "*bf16"}  # fmt: skip
                consts = {"BLOCK_N": bn, "BLOCK_K": bk, "STAGES": stages}
            try:
                kernel = _compile(jit, ptrs, consts, num_warps=warps)
                ptx = kernel.asm["ptx"]
                row = {"kind": kind, "tile": tile, "shared": kernel.metadata.shared,
                       **resources(kernel), "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
                       "cp_async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
                       "loop": loop_mix(kernel, bn * bk // (32 * warps))}  # fmt: skip
                print(json.dumps(row), flush=True)
            except Exception as e:  # noqa: BLE001 (a report: name the failure, go on)
                print(json.dumps({"kind": kind, "tile": tile, "error": str(e)[:300]}), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="o_proj,qkv,down,gate_up")
    p.add_argument("--variants", default="engine,read,read-pdl,read-tma,gemv-tma")
    p.add_argument("--layer", action="store_true", help="a layer's four launches in order too")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--sm90-report", action="store_true")
    args = p.parse_args(argv)
    if args.sm90_report:
        sm90_report()
    else:
        bench(args)


if __name__ == "__main__":
    main()
