"""GGUF dequantization: the ``gguf`` package's numpy against ours (``flashserve.loaders.
gguf_quants``, torch, on the CPU and, where there is one, on the GPU with the packed bytes
copied there from the memory map), weights a second by type, on a tensor the size of a
Llama-3.1-8B MLP matrix (14336 x 4096) of random bytes; then a whole-model estimate: an 8B
model of that type, 8.03e9 weights, at each rate.

    python3 docs/benchmarks/gguf_dequant_bench.py [--types Q4_K,Q6_K,...] [--json FILE]

Each of ours is checked against the package's values (bit for bit, NaN where it has NaN)
before it is timed; each of ours is the median of 3 runs after one warm-up, numpy's one run
(it takes seconds).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import gguf
import numpy as np
import torch

from flashserve.loaders.gguf_quants import TYPES, dequantize

Q = gguf.GGMLQuantizationType
ROWS, COLS = 14336, 4096
MODEL_WEIGHTS = 8.03e9


def median_seconds(fn, sync=lambda: None, runs: int = 3, warm_up: bool = True) -> float:
    if warm_up:
        fn()
        sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, cuda: bool) -> dict:
    qtype = Q[name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.randint(0, 256, (ROWS, COLS // block * block_bytes), dtype=np.uint8)
    with np.errstate(all="ignore"):
        want = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype)))
        numpy_s = median_seconds(lambda: gguf.quants.dequantize(raw, qtype), runs=1, warm_up=False)
    packed = torch.from_numpy(raw)
    torch.testing.assert_close(dequantize(packed, qtype), want, rtol=0, atol=0, equal_nan=True)
    row = {"type": name, "weights": ROWS * COLS, "numpy_s": numpy_s,
           "torch_cpu_s": median_seconds(lambda: dequantize(packed, qtype))}  # fmt: skip
    if cuda:
        got = dequantize(packed.cuda(), qtype).cpu()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        row["torch_cuda_s"] = median_seconds(
            lambda: dequantize(packed.to("cuda"), qtype), torch.cuda.synchronize
        )  # the copy of the packed bytes from host memory included
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    default = ",".join(sorted(t.name for t in TYPES if t.name.startswith("Q")))
    ap.add_argument("--types", default=default)
    ap.add_argument("--json")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    rows = [measure(name, cuda) for name in args.types.split(",")]
    device = torch.cuda.get_device_name() if cuda else "no GPU"
    print(f"{ROWS}x{COLS} weights; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; {device}; an 8B model's 8.03e9 weights in seconds at each rate")  # fmt: skip
    print("| type | numpy M/s (8B s) | torch CPU M/s (8B s) | torch CUDA M/s (8B s) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        cells = []
        for key in ("numpy_s", "torch_cpu_s", "torch_cuda_s"):
            if key in r:
                rate = r["weights"] / r[key]
                cells.append(f"{rate / 1e6:,.0f} ({MODEL_WEIGHTS / rate:,.1f})")
            else:
                cells.append("-")
        print(f"| {r['type']} | " + " | ".join(cells) + " |")
    if args.json:
        meta = {"torch": torch.__version__, "gguf": importlib.metadata.version("gguf"),
                "device": device, "threads": torch.get_num_threads()}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
