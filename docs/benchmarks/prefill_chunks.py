"""The Gluon prefill kernel on whole prompts and on chunks at the end of long contexts (the
engine's prefill steps: a chunk of queries over every earlier key), at its default tiles and
three others, 128-token pages; µs and TFLOP/s counting the keys each query sees
(docs/benchmarks/kernels.md, session 21).

    python3 docs/benchmarks/prefill_chunks.py chunks.json
"""

import json
import sys

import torch

from kernels import bench
from kernels.prefill_gluon import GluonConfig as G

HQ, D = bench.HQ, bench.D
rows = []
cfgs = [None, G(128, 2), G(128, 3, pingpong=False), G(64, 4)]
points = [(16384, 16384), (2048, 32768), (2048, 65536), (2048, 131072), (8192, 131072),
          (4096, 131072)]  # fmt: skip
for chunk, ctx in points:
    flops = 4 * HQ * D * chunk * (ctx - chunk / 2)
    for cfg in cfgs:
        kw = {"path": "gluon"} if cfg is None else {"path": "gluon", "config": cfg}
        try:
            us = bench.time_prefill_chunk(chunk, ctx, page=128, **kw)
        except Exception as e:
            print("fail", chunk, ctx, cfg, e)
            continue
        tf = flops / us / 1e6
        rows.append({"chunk": chunk, "ctx": ctx, "cfg": str(cfg), "us": us, "tflops": tf})
        name = str(cfg)[11:70] if cfg else "default"
        print(f"chunk {chunk:6} ctx {ctx:7} {name:60} {us:10.1f} us {tf:6.1f} TFLOP/s", flush=True)
        torch.cuda.empty_cache()
json.dump(rows, open(sys.argv[1], "w"), indent=1)
