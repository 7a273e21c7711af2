"""Attention kernel benchmarks: ``python -m kernels.bench [--sweep] [--json FILE]``.

Decode: batch {1, 8, 32} x context {4K, 16K, 64K, 128K}, Llama-3-8B heads (32 query, 8 KV,
dim 128), bf16, every sequence at the full context. Each implementation is timed under CUDA
graph replay (the way the engine runs decode): one graph holds 16+ calls that rotate over
several input sets (KV pools, shuffled block tables, queries) totalling >= 256 MB, so the
50 MB L2 does not serve the KV; the median over replays divided by the calls is reported.
Peers: torch SDPA on contiguous KV (enable_gqa) and, if importable, xformers' triton_splitk
on paged KV (page 256). Prefill: causal, batch 1, 4K and 16K tokens, beside SDPA's
FlashAttention-2 and cuDNN backends: ours portable at pages 16, 64 and 128, the Hopper path
(``path="hopper"``: TMA copies, persistent programs) and the Gluon kernel (``path="gluon"``:
FlashAttention-3 style, sm_90 only) at pages 64 and 128 (``--batches "" --prefill
4096,16384``: the prefill table alone; with ``--kv-dtype fp8`` the Gluon kernel's columns stay
empty: it takes bf16 caches only). The device-to-device copy bandwidth is
measured in the same run and is the 100% of the decode table's % columns (GB/s: KV bytes read
per second). ``--sweep`` times tuning variants instead. ``--kv-dtype fp8`` runs our decode and
prefill over an fp8 cache (e4m3 pages and their bf16 scales, ``kernels.kv_quant``) instead of
bf16, in the grid, the sweeps and the window table; its GB/s and % count the bytes it reads
(fp8 values and scales), the peers' their bf16 ones.

``--window W`` times sliding windows instead (issue 14's target: at 128K context, a layer with
a 4,096-token window within 10% of the same kernel at a 4K context). Decode, per head shape
and batch: the global kernel at a context of W, the windowed kernel at W, and the windowed
kernel at ``--window-context`` (128K). Prefill, per chunk of C tokens: the chunk after W
cached tokens (global, then windowed: each query sees W keys), and the windowed chunk at the
end of the long context. The windowed inputs hold only the window's pages (the block-table
entries left of it point at arbitrary pages the kernels never read), so the input sets rotate
over the bytes actually read, as the global ones do; ratios are the long context's time over
each 4K one's (medians of alternated rounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from kernels.prefill_gluon import GluonConfig as G  # a dataclass: nothing compiles on import

SMOKE = os.environ.get("TRITON_INTERPRET") == "1"  # CPU smoke test of this script only
DEV = "cpu" if SMOKE else "cuda"
HQ, HKV, D = 32, 8, 128
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter has no bf16 dot
ROTATE_BYTES = 256 << 20  # input sets per graph: at least this many KV bytes, 5x the L2
KV_DTYPES = ("bf16", "fp8")  # --kv-dtype: our cache's (bf16 means DT, fp16 in the smoke test)


# ---------------------------------------------------------------- timing


def graph_time(calls: list[Callable[[], object]], min_calls: int = 16, reps: int = 10) -> float:
    """Median µs per call of ``calls`` (cycled to >= min_calls) captured in one CUDA graph."""
    if SMOKE:
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) / len(calls) * 1e6
    seq = calls * math.ceil(min_calls / len(calls))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # compile, autotune, allocate outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3 / len(seq))
    del graph
    return statistics.median(times)


def bench_time(fn: Callable[[], object]) -> float:
    """Median µs of one call outside a graph (long kernels: prefill, copies)."""
    if SMOKE:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3


def run_meta() -> dict:
    """A benchmark's record of its run: the device, torch's, Triton's and Python's versions, the
    date (UTC) and the command's arguments (this module, ``kernels.bench_gemv`` and
    ``kernels.bench_fp8``, ``docs/benchmarks/*_ceiling.py``)."""
    import triton

    device = "cpu (TRITON_INTERPRET)" if SMOKE else torch.cuda.get_device_name()
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "argv": sys.argv[1:]}  # fmt: skip


def copy_bandwidth() -> float:
    """Device-to-device copy, GB/s counting bytes read + written."""
    n = 1 << 20 if SMOKE else 2 << 30
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    us = bench_time(lambda: dst.copy_(src))
    return 2 * n / us / 1e3


# ---------------------------------------------------------------- decode inputs


def kv_pools(nb: int, page: int, hkv: int, d: int, kv: str = "bf16") -> dict:
    """Random K and V pools ``[nb, page, hkv, d]`` as keyword arguments of our kernels: DT
    pages, or (``kv="fp8"``) their e4m3 quantization with its scale pools."""
    from kernels.kv_quant import FP8_KV_DTYPE, KV_SCALE_DTYPE, kv_scale_shape, quantize_fp8

    if kv == "bf16":
        return {name: torch.randn(nb, page, hkv, d, device=DEV, dtype=DT)
                for name in ("k_cache", "v_cache")}  # fmt: skip
    pools = {}
    for name in ("k", "v"):  # quantized a few blocks at a time: no full-size float32 copy
        pages = torch.empty(nb, page, hkv, d, device=DEV, dtype=FP8_KV_DTYPE)
        scales = torch.empty(kv_scale_shape(nb, page, hkv), device=DEV, dtype=KV_SCALE_DTYPE)
        for i in range(0, nb, 4096):
            x = torch.randn(min(4096, nb - i), page, hkv, d, device=DEV, dtype=DT)
            pages[i : i + len(x)], s = quantize_fp8(x)
            scales[i : i + len(x)] = s.transpose(1, 2)
        pools.update({f"{name}_cache": pages, f"{name}_scale": scales})
    return pools


class DecodeInputs:
    """``n`` independent input sets for one (batch, context) point, paged with ``page``; the
    pages of a set are shuffled, or with ``shuffle=False`` in order (each sequence contiguous).
    ``live``: only the pages of each sequence's last ``live`` tokens exist (a sliding window's);
    the block-table entries left of them point at random pages of the set. ``kv``: the cache's
    dtype (``kv_pools``); a set is (q, pools, block table, out)."""

    def __init__(
        self, bsz: int, ctx: int, page: int, n: int, hq: int = HQ, hkv: int = HKV, shuffle=True,
        d: int = D, live: int | None = None, kv: str = "bf16",
    ):  # fmt: skip
        self.bsz, self.ctx, self.page = bsz, ctx, page
        width = -(-ctx // page)  # a partial last page too (32,800 tokens: 257 pages of 128)
        first = 0 if live is None else max(0, ctx - live) // page  # the first live page
        nb = bsz * (width - first)
        self.sets = []
        for _ in range(n):
            pools = kv_pools(nb, page, hkv, d, kv)
            ids = torch.randperm(nb, device=DEV) if shuffle else torch.arange(nb, device=DEV)
            bt = torch.randint(0, nb, (bsz, width), device=DEV, dtype=torch.int32)
            bt[:, first:] = ids.to(torch.int32).view(bsz, width - first)
            q = torch.randn(bsz, hq, d, device=DEV, dtype=DT)
            self.sets.append((q, pools, bt, torch.empty_like(q)))
        self.seq_lens = torch.full((bsz,), ctx, dtype=torch.int32, device=DEV)


def kv_bytes(bsz: int, ctx: int, hkv: int = HKV, d: int = D, kv: str = "bf16") -> int:
    """K and V bytes of ``bsz`` sequences of ``ctx`` tokens: an fp8 cache's scales included."""
    from kernels.kv_quant import FP8_KV_DTYPE, kv_bytes_per_token_layer

    return bsz * ctx * kv_bytes_per_token_layer(hkv, d, FP8_KV_DTYPE if kv == "fp8" else DT)


def n_sets(bsz: int, ctx: int, hkv: int = HKV, d: int = D, kv: str = "bf16") -> int:
    if SMOKE:
        return 1
    return max(1, min(16, math.ceil(ROTATE_BYTES / kv_bytes(bsz, ctx, hkv, d, kv))))


def time_ours(bsz, ctx, page=16, hq=HQ, hkv=HKV, shuffle=True, d=D, window=0, kv="bf16",
              **kw) -> float:  # fmt: skip
    """µs per decode call; ``window`` > 0: windowed calls over pools of the window's pages;
    ``kv``: the cache's dtype (``kv_pools``)."""
    from kernels.decode import decode_attention

    read = min(ctx, window) if window else ctx  # tokens a row reads: the rotation's bytes
    inp = DecodeInputs(bsz, ctx, page, n_sets(bsz, read, hkv, d, kv), hq, hkv, shuffle, d,
                       live=window or None, kv=kv)  # fmt: skip
    sl, scale = inp.seq_lens, d**-0.5
    calls = [
        (
            lambda q=q, pools=pools, bt=bt, out=out: decode_attention(
                q,
                seq_lens=sl,
                block_tables=bt,
                scale=scale,
                max_seq_len=ctx,
                out=out,
                window=window,
                **pools,
                **kw,
            )
        )  # fmt: skip
        for q, pools, bt, out in inp.sets
    ]
    return graph_time(calls)


def time_sdpa(bsz, ctx) -> float:
    import torch.nn.functional as F

    sets = []
    for _ in range(n_sets(bsz, ctx)):
        q = torch.randn(bsz, HQ, 1, D, device=DEV, dtype=DT)
        k = torch.randn(bsz, HKV, ctx, D, device=DEV, dtype=DT)
        sets.append((q, k, torch.randn_like(k)))
    calls = [
        (lambda s=s: F.scaled_dot_product_attention(s[0], s[1], s[2], enable_gqa=True))
        for s in sets
    ]
    return graph_time(calls)


def time_xformers(bsz, ctx, graph: bool = True) -> float:
    import xformers.ops.fmha as fmha

    fmha.common._built_with_cuda = True  # its C++ part targets another torch; Triton needs none
    from xformers.ops.fmha import triton_splitk
    from xformers.ops.fmha.attn_bias import (
        BlockDiagonalPaddedKeysMask,
        PagedBlockDiagonalPaddedKeysMask,
    )

    page = 256
    inp = DecodeInputs(bsz, ctx, page, n_sets(bsz, ctx))
    calls = []
    for q, pools, bt, _ in inp.sets:
        k, v = pools["k_cache"], pools["v_cache"]
        bias = BlockDiagonalPaddedKeysMask.from_seqlens(
            q_seqlen=[1] * bsz, kv_padding=ctx, kv_seqlen=[ctx] * bsz, device=q.device
        ).make_paged(bt, page_size=page, paged_type=PagedBlockDiagonalPaddedKeysMask)
        g = HQ // HKV
        xq = q.view(1, bsz, HKV, g, D)
        xk = k.view(1, -1, HKV, 1, D).expand(1, k.shape[0] * page, HKV, g, D)
        xv = v.view(1, -1, HKV, 1, D).expand(1, v.shape[0] * page, HKV, g, D)
        calls.append(
            lambda xq=xq, xk=xk, xv=xv, bias=bias: fmha.memory_efficient_attention_forward(
                xq, xk, xv, attn_bias=bias, op=triton_splitk.FwOp
            )
        )
    if graph:
        return graph_time(calls)
    return statistics.median(bench_time(c) for c in calls)


# ---------------------------------------------------------------- prefill


def prefill_flops(n: int) -> float:
    return 4 * HQ * D * n * n / 2  # QK^T and PV, causal half


def time_prefill_ours(n: int, page: int = 16, d: int = D, kv: str = "bf16", **kw) -> float:
    """µs of one whole-prompt prefill of ``n`` tokens (``time_prefill_chunk`` with no context)."""
    return time_prefill_chunk(n, n, d=d, page=page, kv=kv, **kw)


def time_prefill_chunk(
    chunk: int, seq_len: int, window: int = 0, hq: int = HQ, hkv: int = HKV, d: int = D,
    page: int = 16, kv: str = "bf16", **kw,
) -> float:  # fmt: skip
    """µs of one prefill call: a chunk of ``chunk`` queries at the end of ``seq_len`` tokens;
    with a ``window``, the pool holds only the pages from the chunk's first window on."""
    from kernels.prefill import prefill_attention

    width = -(-seq_len // page)
    first = max(0, seq_len - chunk - window + 1) // page if window else 0
    nb = width - first
    pools = kv_pools(nb, page, hkv, d, kv)
    bt = torch.randint(0, nb, (1, width), device=DEV, dtype=torch.int32)
    bt[0, first:] = torch.randperm(nb, device=DEV, dtype=torch.int32)
    q = torch.randn(chunk, hq, d, device=DEV, dtype=DT)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
    sl = torch.tensor([seq_len], dtype=torch.int32, device=DEV)
    out = torch.empty_like(q)
    return bench_time(
        lambda: prefill_attention(
            q,
            cu_seqlens_q=cu,
            seq_lens=sl,
            block_tables=bt,
            scale=d**-0.5,
            max_query_len=chunk,
            max_seq_len=seq_len,
            out=out,
            window=window,
            **pools,
            **kw,
        )  # fmt: skip
    )


def time_prefill_sdpa(n: int, backend: str) -> float:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, HQ, n, D, device=DEV, dtype=DT)
    k = torch.randn(1, HKV, n, D, device=DEV, dtype=DT)
    v = torch.randn_like(k)
    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel([chosen]):
        try:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:  # backend without GQA: expand K/V (not counted in the time)
            ke, ve = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
            fn = lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
        return bench_time(fn)


# ---------------------------------------------------------------- runs


def attempt(fn, *args, **kw):
    try:
        return fn(*args, **kw)
    except Exception as e:  # a peer that fails still leaves the rest of the table
        print(f"  ! {getattr(fn, '__name__', fn)}{args} {kw}: {type(e).__name__}: {e}"[:400])
        return None
    finally:
        if not SMOKE:
            torch.cuda.empty_cache()


def fits(bsz: int, ctx: int) -> bool:
    if SMOKE:
        return True
    free, _ = torch.cuda.mem_get_info()
    return kv_bytes(bsz, ctx) * 1.3 < free  # bf16: the peers' and the fp8 inputs' source


ROUNDS = 1 if SMOKE else 3  # decode grid: ours and SDPA timed this many times, alternated


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def decode_grid(batches, contexts, copy_gbs, have_xf, kv="bf16") -> list[dict]:
    """Ours over a ``kv`` cache beside the peers (bf16); each one's GB/s and % of the copy
    bandwidth count the bytes it reads (``kv_mb`` ours, ``peer_kv_mb`` the peers')."""
    rows = []
    for bsz in batches:
        for ctx in contexts:
            if not fits(bsz, ctx):
                print(f"  skip B={bsz} ctx={ctx}: does not fit")
                continue
            r = {"batch": bsz, "context": ctx, "kv_dtype": kv,
                 "kv_mb": kv_bytes(bsz, ctx, kv=kv) / 1e6,
                 "peer_kv_mb": kv_bytes(bsz, ctx) / 1e6}  # fmt: skip
            ours, sdpa = [], []
            for _ in range(ROUNDS):  # alternated, so that drifting clocks hit both alike
                ours.append(attempt(time_ours, bsz, ctx, kv=kv))
                sdpa.append(attempt(time_sdpa, bsz, ctx))
            r["ours_us"], r["sdpa_us"] = _median(ours), _median(sdpa)
            r["ours_rounds"], r["sdpa_rounds"] = ours, sdpa
            r["xformers_us"], r["xformers_graph"] = None, None
            if have_xf:  # under a graph if its capture works, else plain launches (noted)
                for graph in (True, False):
                    r["xformers_us"] = attempt(time_xformers, bsz, ctx, graph=graph)
                    if r["xformers_us"] is not None:
                        r["xformers_graph"] = graph
                        break
            for key in ("ours", "sdpa", "xformers"):
                us = r[f"{key}_us"]
                mb = r["kv_mb"] if key == "ours" else r["peer_kv_mb"]
                r[f"{key}_gbs"] = mb * 1e6 / us / 1e3 if us else None
                r[f"{key}_pct"] = r[f"{key}_gbs"] / copy_gbs * 100 if us else None
            rows.append(r)
            print("  " + json.dumps(r), flush=True)
    return rows


PREFILL_COLUMNS = (  # name, page, path: the portable kernel, the Hopper path, the Gluon kernel
    ("ours_page16", 16, "portable"),
    ("ours_page64", 64, "portable"),
    ("ours_page128", 128, "portable"),
    ("hopper_page64", 64, "hopper"),
    ("hopper_page128", 128, "hopper"),
    ("gluon_page64", 64, "gluon"),
    ("gluon_page128", 128, "gluon"),
)


def prefill_table(sizes, kv="bf16") -> list[dict]:
    """Per prompt length: ours per (page, path) of PREFILL_COLUMNS, SDPA's backends. The
    Gluon kernel takes bf16 caches only (``gluon_refusal``): its columns stay empty with fp8,
    where the portable kernel and the Hopper path read e4m3 pages and their scales."""
    rows = []
    for n in sizes:
        r = {"tokens": n, "kv_dtype": kv}
        for name, page, path in PREFILL_COLUMNS:
            no_fp8 = path == "gluon" and kv == "fp8"
            us = None if no_fp8 else attempt(time_prefill_ours, n, page, kv=kv, path=path)
            r[f"{name}_us"] = us
            r[f"{name}_tflops"] = prefill_flops(n) / us / 1e6 if us else None
        for backend in ("flash", "cudnn"):
            us = attempt(time_prefill_sdpa, n, backend)
            r[f"sdpa_{backend}_us"] = us
            r[f"sdpa_{backend}_tflops"] = prefill_flops(n) / us / 1e6 if us else None
        rows.append(r)
        print("  " + json.dumps(r), flush=True)
    return rows


WINDOW_VARIANTS = ("global_4k", "window_4k", "window_long")


def window_table(window: int, long_ctx: int, heads, batches, chunks, softcap=0.0,
                 kv="bf16") -> list[dict]:  # fmt: skip
    """The sliding-window target (module doc): per head shape ``(hq, hkv, d)``, decode per
    batch and prefill per chunk, the three variants timed ``ROUNDS`` times, alternated."""
    rows = []
    for hq, hkv, d in heads:
        common = {"hq": hq, "hkv": hkv, "d": d, "softcap": softcap, "kv": kv}
        for kind, n in [("decode", b) for b in batches] + [("prefill", c) for c in chunks]:
            if kind == "decode":  # a row reads `window` tokens in all three
                fn, short, long = time_ours, (n, window), (n, long_ctx)
            else:  # after `window` cached tokens: each query sees window + i keys, or window
                fn, short, long = time_prefill_chunk, (n, window + n), (n, long_ctx)
            runs = {"global_4k": (short, 0), "window_4k": (short, window),
                    "window_long": (long, window)}  # fmt: skip
            times = {v: [] for v in WINDOW_VARIANTS}
            for _ in range(ROUNDS):
                for v in WINDOW_VARIANTS:
                    args, w = runs[v]
                    times[v].append(attempt(fn, *args, window=w, **common))
            r = {"kind": kind, "heads": f"{hq}/{hkv}/{d}",
                 "batch" if kind == "decode" else "chunk": n, "window": window,
                 "long_context": long_ctx, "softcap": softcap}  # fmt: skip
            for v in WINDOW_VARIANTS:
                r[f"{v}_us"], r[f"{v}_rounds"] = _median(times[v]), times[v]
            long_us = r["window_long_us"]
            for base in ("global_4k", "window_4k"):
                us = r[f"{base}_us"]
                r[f"long_over_{base}"] = long_us / us if long_us and us else None
            rows.append(r)
            print("  " + json.dumps(r), flush=True)
    return rows


def print_window_table(rows: list[dict]) -> None:
    if not rows:
        return
    w, long_ctx = rows[0]["window"], rows[0]["long_context"]
    print(f"\nwindow {w}, long context {long_ctx // 1024}K, soft-cap {rows[0]['softcap']}: "
          f"µs; the target is {long_ctx // 1024}K windowed / 4K at most 1.10")  # fmt: skip
    print("| kernel | heads | batch / chunk | global @ctx W | windowed @ctx W | windowed @long "
          "| long / global | long / windowed |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        n = r.get("batch", r.get("chunk"))
        cells = [fmt(r[f"{v}_us"], ",.1f") for v in WINDOW_VARIANTS]
        cells += [fmt(r["long_over_global_4k"], ".3f"), fmt(r["long_over_window_4k"], ".3f")]
        print(f"| {r['kind']} | {r['heads']} | {n} | " + " | ".join(cells) + " |")


# per-sm: stage-1 programs an SM the split heuristic aims for (DecodeTuning.programs_per_sm;
# the launcher caps it by shared memory only), over tiles that fit more than 2 an SM. Over an
# fp8 cache (sm_90 compile reports with Triton 3.6, the GPU's: tests/sm90_compile.py
# --fp8-configs): (128, 4, 3) 104 KB of shared memory: 2 an SM (today's); (128, 4, 2) 72 KB
# but 190 registers a thread: still 2; (64, 4, 3) 55 KB, 128 registers: 4; (64, 4, 4) 71 KB:
# 3; (64, 8, 4) 71 KB, 80 registers: 3.
PER_SM_CONFIGS = {
    "bf16": [(64, 4, 3), (64, 4, 2)],
    "fp8": [(128, 4, 3), (64, 4, 3), (64, 4, 4), (64, 8, 4)],
}
PER_SM_CHOICES = (1, 2, 3, 4)
DECODE_CONFIGS = [  # DecodeTuning.tiles; the first is decode_config's default
    (64, 4, 4), (64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 4, 2), (64, 8, 3), (64, 8, 4),
    (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
]  # fmt: skip
# Over an fp8 cache (--kv-dtype fp8): a 128-token e4m3 tile carries a 64-token bf16 tile's
# bytes; the first is DecodeTuning.fp8_tiles. Compile reports of each: tests/sm90_compile.py
# --fp8-configs (docs/benchmarks/fp8.md).
FP8_DECODE_CONFIGS = [
    (128, 4, 3), (128, 8, 3), (128, 8, 2), (128, 8, 4), (128, 4, 2), (128, 4, 4),
    (64, 4, 4), (64, 4, 3), (64, 4, 5), (64, 4, 6), (64, 8, 4), (64, 8, 6),
]  # fmt: skip
PREFILL_CONFIGS = {  # head dim: [(BLOCK_M, BLOCK_N, num_warps, num_stages)]
    128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2),
          (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)],
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3),
         (128, 32, 4, 4)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 3),
          (128, 64, 8, 2)],
}  # fmt: skip
SWEEP_POINTS = [(1, 4096), (1, 16384), (1, 65536), (1, 131072), (8, 4096), (8, 16384),
                (32, 4096), (32, 131072)]  # fmt: skip
HOPPER_CONFIGS = {  # head dim: [(BLOCK_M, BLOCK_N, num_warps, num_stages, programs_per_sm)]
    # programs_per_sm 0: a plain grid (one program per work item, the hardware's order); 2:
    # only where two fit an SM (228 KiB of shared memory, 64K registers; sm90_compile)
    128: [(128, 128, 8, 3, 1), (128, 128, 8, 2, 1), (128, 128, 8, 3, 0), (128, 64, 8, 4, 1),
          (128, 64, 8, 3, 1), (128, 64, 8, 2, 1), (128, 64, 8, 4, 0), (64, 64, 4, 2, 2),
          (64, 128, 4, 2, 1)],
    64: [(128, 64, 8, 4, 1), (128, 64, 8, 4, 2), (128, 128, 8, 4, 1), (128, 64, 4, 4, 1),
         (128, 64, 8, 4, 0), (64, 64, 4, 4, 2)],
    256: [(128, 64, 8, 2, 1), (128, 64, 8, 2, 0), (64, 64, 4, 2, 1), (64, 64, 4, 3, 1),
          (128, 32, 8, 3, 1)],
}  # fmt: skip
# over an fp8 cache (--kv-dtype fp8) also deeper pipelines, which only e4m3 stages fit beside the
# query tile (d128, (128, 128, 8, 4): 198,656 bytes of shared memory; sm90_compile)
HOPPER_FP8_CONFIGS = {128: [(128, 128, 8, 4, 1)], 64: [], 256: [(128, 64, 8, 3, 1),
                                                               (128, 64, 8, 4, 1)]}  # fmt: skip
HOPPER_SWEEP_POINTS = [(16384, 128, 128), (16384, 128, 64), (4096, 128, 128), (4096, 128, 64),
                       (4096, 64, 64), (4096, 256, 64)]  # (tokens, head dim, page)  # fmt: skip
GLUON_CONFIGS = {  # head dim: [GluonConfig], the default first (sm90_compile: none spills but
    # d256's (64, 2), a 48-byte stack; consumers at 232 registers spilled at d128: not kept)
    128: [G(128, 3), G(128, 2), G(128, 3, pingpong=False), G(64, 4), G(64, 3)],
    64: [G(128, 4), G(64, 4), G(128, 4, pingpong=False), G(128, 2)],
    256: [G(64, 2), G(64, 2, pingpong=False), G(32, 4)],
}  # fmt: skip
SWEEPS = ("decode-config", "per-sm", "pdl", "layout", "splits", "page", "prefill", "hopper",
          "gluon")  # fmt: skip
SPLIT_CHOICES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def sweep(which: list[str], points=None, kv="bf16", heads=(HQ, HKV), page=16,
          shuffle=True) -> list[dict]:  # fmt: skip
    """Tuning variants, one record each: {"sweep", "batch", "context", "variant", "us"}.

    Decode variants are ``DecodeTuning`` values or call arguments, never module state.
    decode-config: stage-1 (BLOCK_N, warps, stages) (``DecodeTuning.tiles``;
    ``FP8_DECODE_CONFIGS`` over an fp8 cache); per-sm: the stage-1 programs an SM the split
    heuristic aims for (``DecodeTuning.programs_per_sm``, ``PER_SM_CHOICES``) over the tiles
    of ``PER_SM_CONFIGS``; pdl: programmatic dependent launch on or off
    (``DecodeTuning.pdl``); layout: the same KV bytes placed differently: [N, BS, Hkv, D]
    pages shuffled or in order, or one KV head per sequence (a head's rows contiguous within a
    page: the layout of a head-major cache) in pages of 16 or 128 tokens or wholly contiguous
    (SDPA's layout); splits: split counts (at most two waves of 3 programs per SM); page: page
    sizes; prefill: tile configs (TFLOP/s in "tflops"); hopper: the Hopper prefill path's tile
    configs and persistent programs per SM (``HOPPER_CONFIGS``, and ``HOPPER_FP8_CONFIGS``
    over an fp8 cache) per (tokens, head dim, page), the portable kernel's default beside them
    (variant "portable"); gluon: the Gluon kernel's ``GluonConfig`` values (``GLUON_CONFIGS``,
    as tuples) at the same points, the Hopper path's default beside them (variant "hopper").
    ``points``: (batch, context) pairs for the decode sweeps. ``kv``: our cache's dtype in
    every variant. ``heads`` (query, KV heads) and ``page`` (tokens): the decode-config,
    splits and per-sm sweeps' (a rank's heads under tensor parallelism: 16/4 at 2 for
    Llama-3-8B), and ``shuffle`` their pages' order (False: in order, as the engine's block
    manager hands out a fresh pool's blocks); splits times the heuristic's own choice too
    (variant "heuristic"). Variants that lost (K/V load hints, loop variants, the combine
    kernel, a stage fewer for short splits): docs/benchmarks/kernels-notes.md and decode.md.
    """
    from kernels.decode import DecodeTuning

    res = []
    pts = points or (SWEEP_POINTS if not SMOKE else [(1, 256)])
    # decode-config, splits, per-sm
    hw = {"kv": kv, "hq": heads[0], "hkv": heads[1], "page": page, "shuffle": shuffle}

    def rec(kind, bsz, ctx, variant, us, **extra):
        res.append({"sweep": kind, "batch": bsz, "context": ctx, "variant": variant, "us": us,
                    "kv_dtype": kv, **extra})  # fmt: skip
        print(f"  {kind} B={bsz} ctx={ctx} {variant}: {fmt(us, '.1f')}", flush=True)

    if "decode-config" in which:
        for bsz, ctx in pts:
            for cfg in FP8_DECODE_CONFIGS if kv == "fp8" else DECODE_CONFIGS:
                tuning = DecodeTuning(tiles=cfg)
                rec("decode-config", bsz, ctx, cfg,
                    attempt(time_ours, bsz, ctx, tuning=tuning, **hw))  # fmt: skip

    if "per-sm" in which:  # the variant "(BLOCK_N, warps, stages) xP"; P is capped by smem
        for bsz, ctx in pts:
            for cfg in PER_SM_CONFIGS[kv]:
                for per_sm in PER_SM_CHOICES:
                    tuning = DecodeTuning(tiles=cfg, programs_per_sm=per_sm)
                    rec("per-sm", bsz, ctx, f"{cfg} x{per_sm}",
                        attempt(time_ours, bsz, ctx, tuning=tuning, **hw))  # fmt: skip
    if "pdl" in which:
        for bsz, ctx in pts:
            for name, tuning in (("none", DecodeTuning(pdl=False)), ("pdl", DecodeTuning())):
                rec("pdl", bsz, ctx, name, attempt(time_ours, bsz, ctx, tuning=tuning, kv=kv))
    if "layout" in which:  # what the KV placement costs: the kernel alone on SDPA's layout
        variants = (  # name, batch factor, time_ours kwargs
            ("8 heads/page, page 16, shuffled", 1, {}),
            ("8 heads/page, page 16, in order", 1, {"shuffle": False}),
            ("1 head/seq, page 16 (4 KB), shuffled", HKV, {"hq": HQ // HKV, "hkv": 1}),
            ("1 head/seq, page 128 (32 KB), shuffled", HKV,
             {"hq": HQ // HKV, "hkv": 1, "page": 128}),
            ("1 head/seq, in order (contiguous)", HKV,
             {"hq": HQ // HKV, "hkv": 1, "shuffle": False}),
        )  # fmt: skip
        default = [(1, 131072), (8, 16384), (8, 131072), (32, 16384)] if not SMOKE else pts
        for bsz, ctx in points or default:
            for name, factor, kw in variants:
                rec("layout", bsz, ctx, name,
                    attempt(time_ours, bsz * factor, ctx, kv=kv, **kw))  # fmt: skip
    if "splits" in which:
        for bsz, ctx in pts:
            rec("splits", bsz, ctx, "heuristic", attempt(time_ours, bsz, ctx, **hw))
            for sp in SPLIT_CHOICES:
                if sp * 64 <= ctx and bsz * heads[1] * sp <= 3 * 132 * 2:
                    rec("splits", bsz, ctx, sp,
                        attempt(time_ours, bsz, ctx, num_splits=sp, **hw))  # fmt: skip
    if "page" in which:
        for bsz, ctx in pts:
            for page in (16, 64, 256):
                rec("page", bsz, ctx, page, attempt(time_ours, bsz, ctx, page=page, kv=kv))
    if "prefill" in which:
        for n, d in (
            [(16384, 128), (4096, 128), (4096, 64), (4096, 256)] if not SMOKE else [(256, 64)]
        ):
            for cfg in PREFILL_CONFIGS[d]:
                us = attempt(time_prefill_ours, n, 16, d, config=cfg, kv=kv, path="portable")
                tf = prefill_flops(n) * d / D / us / 1e6 if us else None
                rec("prefill", 1, n, (d, *cfg), us, tflops=tf)
    if "hopper" in which:
        for n, d, page in HOPPER_SWEEP_POINTS if not SMOKE else [(256, 64, 64)]:
            variants = [("portable", {"path": "portable"})]
            cfgs = HOPPER_CONFIGS[d] + (HOPPER_FP8_CONFIGS[d] if kv == "fp8" else [])
            variants += [(cfg, {"path": "hopper", "config": cfg}) for cfg in cfgs
                         if cfg[1] <= page]  # fmt: skip
            for name, kw in variants:
                us = attempt(time_prefill_ours, n, page, d, kv=kv, **kw)
                tf = prefill_flops(n) * d / D / us / 1e6 if us else None
                rec("hopper", 1, n, (d, page, name), us, tflops=tf)
    if "gluon" in which:  # the Hopper sweep's points; the Hopper path's default beside
        for n, d, page in HOPPER_SWEEP_POINTS if not SMOKE else [(256, 64, 64)]:
            variants = [("hopper", {"path": "hopper"})]
            variants += [(cfg, {"path": "gluon", "config": cfg}) for cfg in GLUON_CONFIGS[d]
                         if cfg.block_n <= page]  # fmt: skip
            for cfg, kw in variants:
                name = cfg if isinstance(cfg, str) else dataclasses.astuple(cfg)
                us = attempt(time_prefill_ours, n, page, d, kv=kv, **kw)
                tf = prefill_flops(n) * d / D / us / 1e6 if us else None
                rec("gluon", 1, n, (d, page, name), us, tflops=tf)
    return res


def print_sweep(res: list[dict]) -> None:
    """Per sweep and point, the variants from fastest to slowest."""
    groups: dict = {}
    for r in res:
        groups.setdefault((r["sweep"], r["batch"], r["context"]), []).append(r)
    for (kind, bsz, ctx), rs in groups.items():
        rs = sorted((r for r in rs if r["us"]), key=lambda r: r["us"])
        cells = [f"{r['variant']} {r['us']:.1f}" for r in rs]
        print(f"{kind} B={bsz} ctx={ctx // 1024}K: " + ", ".join(cells))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def print_tables(copy_gbs, dec, pre, kv="bf16"):
    print(f"\ncopy bandwidth: {copy_gbs:,.0f} GB/s (read + write); our KV cache: {kv}")
    print("\n| batch | context | KV MB | ours µs | GB/s | % | SDPA µs | GB/s | % | xformers µs "
          "| GB/s | % |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in dec:
        cells = []
        for k in ("ours", "sdpa", "xformers"):
            cells += [fmt(r[f"{k}_us"], ",.1f"), fmt(r[f"{k}_gbs"], ",.0f"),
                      fmt(r[f"{k}_pct"], ".0f")]  # fmt: skip
        print(
            f"| {r['batch']} | {r['context'] // 1024}K | {r['kv_mb']:,.0f} | "
            + " | ".join(cells)
            + " |"
        )
    keys = [name for name, _, _ in PREFILL_COLUMNS] + ["sdpa_flash", "sdpa_cudnn"]
    heads = [f"{path} p{page}" for _, page, path in PREFILL_COLUMNS] + ["SDPA FA2", "SDPA cuDNN"]
    print("\n| tokens | " + " | ".join(f"{h} µs | TFLOP/s" for h in heads) + " |")
    print("|---" * (1 + 2 * len(keys)) + "|")
    for r in pre:
        cells = []
        for k in keys:
            cells += [fmt(r[f"{k}_us"], ",.0f"), fmt(r[f"{k}_tflops"], ".0f")]
        print(f"| {r['tokens'] // 1024}K | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results to this file")
    ap.add_argument("--sweep", help=f"time tuning variants instead: comma list of {SWEEPS}")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="4096,16384,65536,131072")
    ap.add_argument("--prefill", default="4096,16384")
    ap.add_argument("--points", help="decode sweep points, e.g. 1x4096,32x131072")
    ap.add_argument(
        "--heads",
        default=f"{HQ}/{HKV}",
        help="query/KV heads of the decode-config, splits and per-sm sweeps, e.g. 16/4",
    )
    ap.add_argument("--page", type=int, default=16,
                    help="page of the decode-config, splits and per-sm sweeps")  # fmt: skip
    ap.add_argument("--in-order", action="store_true",
                    help="the decode-config, splits and per-sm sweeps' pages in order, not "
                    "shuffled")  # fmt: skip
    ap.add_argument("--window", type=int, help="time sliding windows of this many tokens "
                    "instead (decode per --batches, prefill per --window-chunks)")  # fmt: skip
    ap.add_argument("--window-context", type=int, default=131072)
    ap.add_argument("--window-chunks", default="512,2048", help="prefill chunk sizes")
    ap.add_argument("--window-heads", default="32/8/128,16/8/256",
                    help="hq/hkv/head_dim shapes: Llama-3-8B's, Gemma-3-12B's")  # fmt: skip
    ap.add_argument("--window-softcap", type=float, default=0.0)
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="bf16",
                    help="our KV cache: bf16 (default) or fp8 (e4m3 with per-token scales); "
                    "the peers stay bf16")  # fmt: skip
    args = ap.parse_args(argv)
    if args.window is not None and (args.window <= 0 or args.window % 16 or
                                    args.window_context % 16):  # fmt: skip
        ap.error("--window and --window-context must be positive multiples of 16 (the page)")

    meta = {
        **run_meta(),
        "command": " ".join([sys.executable.split("/")[-1], "-m", "kernels.bench", *sys.argv[1:]]),
        "kv_dtype": args.kv_dtype,
    }  # fmt: skip
    print(json.dumps(meta), flush=True)
    have_xf = False
    try:
        import xformers  # noqa: F401

        have_xf = not SMOKE
    except ImportError:
        print("  xformers not importable: its column stays empty")
    copy_gbs = copy_bandwidth()
    print(f"  copy {copy_gbs:,.0f} GB/s", flush=True)
    result = {"meta": meta, "copy_gbs": copy_gbs}
    if args.sweep:
        pts = (
            [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
            if args.points
            else None
        )
        heads = tuple(int(x) for x in args.heads.split("/"))
        result["sweep"] = sweep(args.sweep.split(","), pts, args.kv_dtype, heads, args.page,
                                not args.in_order)  # fmt: skip
    elif args.window is not None:
        heads = [tuple(int(x) for x in h.split("/")) for h in args.window_heads.split(",")]
        result["window"] = window_table(
            args.window, args.window_context, heads,
            [int(x) for x in args.batches.split(",") if x],
            [int(x) for x in args.window_chunks.split(",") if x], args.window_softcap,
            args.kv_dtype,
        )  # fmt: skip
    else:
        batches = [int(x) for x in args.batches.split(",") if x]  # "": no decode grid
        contexts = [int(x) for x in args.contexts.split(",") if x]
        result["decode"] = decode_grid(batches, contexts, copy_gbs, have_xf, args.kv_dtype)
        result["prefill"] = prefill_table([int(x) for x in args.prefill.split(",") if x],
                                          args.kv_dtype)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.sweep:
        print_sweep(result["sweep"])
    elif args.window is not None:
        print_window_table(result["window"])
    else:
        print_tables(copy_gbs, result["decode"], result["prefill"], args.kv_dtype)


if __name__ == "__main__":
    main()
