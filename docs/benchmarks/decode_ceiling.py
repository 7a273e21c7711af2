"""What bounds decode attention over an fp8 cache: the KV pages and scales of one batch-1 step
read by a kernel that does next to no math, against ``kernels.decode.decode_attention`` over the
same bytes (a measurement prototype for the GPU, not production code; nothing here gates CI).

    python3 docs/benchmarks/decode_ceiling.py --json OUT.json

The companion of ``gemv_ceiling.py`` (``fp8.md``, session 40), for the step's other stream. The
bytes are laid out as the engine's fp8 pools of 128-token pages are (a KV head's rows of a page
together: 16 KB runs of e4m3, 256-byte runs of bf16 scales), as ``kernels.bench``'s layout sweep
does it: each of the 8 KV heads a sequence of its own (``DecodeInputs`` with 4 query heads on 1
KV head, batch 8 for one sequence), pages shuffled. ``read``: each program (a sequence, a split
of its pages) xors the words of its pages' K and V tiles [128 tokens, 128] and their scales (a
block-table load a page, as the decode kernel's), tiles walked by ``tl.range`` with
``num_stages``, the result stored and checked against the same xor taken by torch. ``decode``:
the engine's kernel at its own tiles and split count. Timing: ``kernels.bench.graph_time``
(one CUDA graph of >= 16 calls rotating over >= 256 MB of input sets, median of 10 replays),
rounds alternated; the copy bandwidth of the same run is the 100% line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kernels.bench import (  # noqa: E402
    DEV,
    SMOKE,
    DecodeInputs,
    copy_bandwidth,
    graph_time,
    kv_bytes,
    n_sets,
    run_meta,
)
from kernels.common import pdl_enter, pdl_kwargs  # noqa: E402
from kernels.decode import decode_attention  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 128
CONTEXTS = (4096, 32768, 131072)
# (splits a sequence, warps, stages): ~2 programs an SM (8 heads x 32 splits), and others
READ_TILES = [(32, 4, 3), (16, 4, 3), (64, 4, 3), (32, 4, 2), (32, 8, 3)]
if SMOKE:  # TRITON_INTERPRET=1: toy sizes on the CPU, a check of the script only
    D, PAGE, CONTEXTS = 32, 16, (256,)
    READ_TILES = [(4, 1, 2), (2, 1, 2)]


@triton.jit
def _read_pages_kernel(K, V, KS, VS, BT, Out, width, per_split, stride_bt, PAGE: tl.constexpr,
                       D4: tl.constexpr, STAGES: tl.constexpr,
                       CHAIN: tl.constexpr = False):  # fmt: skip
    """Out[b, s] = the xor of the K and V words and scales of sequence b's pages [s per_split,
    (s + 1) per_split) (pools as int32 [N, PAGE * D4], scales as int16 [N, PAGE]). CHAIN: in
    the PDL chain, as the decode kernel is (``kernels.common.pdl_enter``)."""
    pdl_enter(CHAIN)
    b = tl.program_id(0)
    s = tl.program_id(1)
    offs = tl.arange(0, PAGE)[:, None] * D4 + tl.arange(0, D4)[None, :]
    offs_s = tl.arange(0, PAGE)
    acc = tl.zeros([PAGE, D4], tl.int32)
    sacc = tl.zeros([PAGE], tl.int16)
    lo = s * per_split
    for p in tl.range(lo, tl.minimum(lo + per_split, width), num_stages=STAGES):
        page = tl.load(BT + b * stride_bt + p).to(tl.int64)
        acc ^= tl.load(K + page * (PAGE * D4) + offs, eviction_policy="evict_first")
        acc ^= tl.load(V + page * (PAGE * D4) + offs, eviction_policy="evict_first")
        sacc ^= tl.load(KS + page * PAGE + offs_s, eviction_policy="evict_first")
        sacc ^= tl.load(VS + page * PAGE + offs_s, eviction_policy="evict_first")
    words = tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(sacc, 0).to(tl.int32)
    tl.store(Out + b * tl.num_programs(1) + s, words)


def _views(pools: dict) -> tuple:
    n = pools["k_cache"].shape[0]
    k, v = (pools[f"{x}_cache"].view(torch.int32).reshape(n, -1) for x in "kv")
    ks, vs = (pools[f"{x}_scale"].view(torch.int16).reshape(n, -1) for x in "kv")
    return k, v, ks, vs


def read_pages(pools: dict, bt: torch.Tensor, out: torch.Tensor, tile: tuple,
               chain: bool = False) -> torch.Tensor:  # fmt: skip
    splits, warps, stages = tile
    width = bt.shape[1]
    per_split = -(-width // splits)
    _read_pages_kernel[(bt.shape[0], splits)](*_views(pools), bt, out, width, per_split,
                                              bt.stride(0), PAGE=PAGE, D4=D // 4, STAGES=stages,
                                              num_warps=warps,
                                              **pdl_kwargs(bt.device, chain))  # fmt: skip
    return out


def read_ref(pools: dict, bt: torch.Tensor, splits: int) -> torch.Tensor:
    """``read_pages``' output, by torch on the CPU (numpy's bitwise_xor.reduce)."""
    import numpy as np

    k, v, ks, vs = (x.cpu().numpy() for x in _views(pools))
    width = bt.shape[1]
    per_split = -(-width // splits)
    out = np.zeros((bt.shape[0], splits), np.int32)
    for b, row in enumerate(bt.cpu().numpy()):
        for s in range(splits):
            pages = row[s * per_split : (s + 1) * per_split]
            w = np.bitwise_xor.reduce(np.concatenate([k[pages], v[pages]]).ravel(), initial=0)
            sc = np.bitwise_xor.reduce(np.concatenate([ks[pages], vs[pages]]).ravel(), initial=0)
            out[b, s] = w ^ np.int32(sc)
    return torch.from_numpy(out)


def point_calls(ctx: int) -> tuple[dict, dict]:
    """Each variant's calls over the rotated input sets of one context, each checked first."""
    hkv, hq, bsz = 1, HQ // HKV, HKV  # a KV head's rows of a page together: 8 sequences
    inp = DecodeInputs(bsz, ctx, PAGE, n_sets(bsz, ctx, hkv, D, "fp8"), hq, hkv, True, D,
                       kv="fp8")  # fmt: skip
    sl = inp.seq_lens
    calls, checks = {}, {}
    q0, pools0, bt0, out0 = inp.sets[0]
    ref = decode_attention(q0, seq_lens=sl, block_tables=bt0, scale=D**-0.5, max_seq_len=ctx,
                           out=torch.empty_like(q0), **pools0)  # fmt: skip
    checks["decode"] = float(torch.isfinite(ref).all())  # the kernel's values: tests/ check them
    calls["decode"] = [
        lambda q=q, p=p, bt=bt, o=o: decode_attention(
            q, seq_lens=sl, block_tables=bt, scale=D**-0.5, max_seq_len=ctx, out=o, **p
        )  # fmt: skip
        for q, p, bt, o in inp.sets
    ]
    width = bt0.shape[1]
    for tile in READ_TILES:
        if tile[0] > width:
            continue
        out = torch.empty(bsz, tile[0], device=DEV, dtype=torch.int32)
        want = read_ref(pools0, bt0, tile[0])
        for chain in (False, True):
            label = f"read{'-pdl' if chain else ''} {tile}"
            got = read_pages(pools0, bt0, out, tile, chain).cpu()
            checks[label] = int((got != want).sum())
            calls[label] = [lambda p=p, bt=bt, o=out, t=tile, c=chain: read_pages(p, bt, o, t, c)
                            for _, p, bt, _ in inp.sets]  # fmt: skip
    return calls, checks


def bench(args) -> None:
    t0 = time.perf_counter()
    meta = run_meta()
    print(json.dumps(meta), flush=True)
    copy = copy_bandwidth()
    print(f"copy {copy:.0f} GB/s", flush=True)
    times: dict = {}
    checks: dict = {}
    for r in range(args.rounds):
        for ctx in CONTEXTS if r % 2 == 0 else CONTEXTS[::-1]:
            calls, chk = point_calls(ctx)
            for label, fns in calls.items():
                checks.setdefault(ctx, {})[label] = chk[label]
                if label != "decode" and chk[label] != 0:
                    print(f"  {ctx} {label}: WRONG ({chk[label]} splits differ)", flush=True)
                    continue
                times.setdefault(ctx, {}).setdefault(label, []).append(graph_time(fns))
            del calls
            torch.cuda.empty_cache()
            print(f"round {r} {ctx} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = []
    for ctx in CONTEXTS:
        nbytes = kv_bytes(HKV, ctx, 1, D, "fp8")
        ideal = nbytes / copy / 1e3
        for label, ts in times.get(ctx, {}).items():
            us = statistics.median(ts)
            rows.append({"context": ctx, "variant": label, "us": round(us, 2), "bytes": nbytes,
                         "rounds": [round(t, 2) for t in ts], "ideal_us": round(ideal, 2),
                         "pct_copy": round(100 * ideal / us, 1),
                         "check": checks[ctx][label]})  # fmt: skip
    print(f"\ncopy {copy:.0f} GB/s; µs (% of copy), medians of {args.rounds} rounds")
    for row in rows:
        print(f"{row['context']:7} {row['variant']:18} {row['us']:8.2f} ({row['pct_copy']:5.1f}%)"
              f"  ideal {row['ideal_us']:.2f}")  # fmt: skip
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "copy_gbs": copy, "rows": rows}, f, indent=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    bench(p.parse_args(argv))


if __name__ == "__main__":
    main()
