"""The fused RoPE + KV-store kernel (``kernels.rope``) at one head a program against all of a
token's heads in one program (its query heads in one, its KV heads in another), µs a call in
a CUDA graph (no PDL chain), for the decode and prefill sizes of Llama 3 8B, Qwen3 8B (q/k
norms) and Gemma 3 12B (q/k norms, head dim 256). Rows rotate over 8 pools past the L2.

    python3 docs/benchmarks/rope_split_bench.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kernels.bench import graph_time  # noqa: E402
from kernels.rope import rope_heads_per_program, rope_write_kv  # noqa: E402

SHAPES = {  # name: (query heads, KV heads, head dim, q/k norms, Gemma's (1 + w))
    "llama3-8b": (32, 8, 128, False, False),
    "qwen3-8b": (32, 8, 128, True, False),
    "gemma3-12b": (16, 8, 256, True, True),
}


def time_rope(shape: tuple, t: int, split: tuple[int, int] | None, rounds: int = 8) -> float:
    hq, hkv, d, norms, unit = shape
    dev, dt = "cuda", torch.bfloat16
    page, blocks = 16, max(64, 2 * t // 16 + 2)
    cos = torch.randn(200_000, d // 2, device=dev, dtype=dt)
    sin = torch.randn(200_000, d // 2, device=dev, dtype=dt)
    qn = torch.randn(d, device=dev, dtype=dt) if norms else None
    kn = torch.randn(d, device=dev, dtype=dt) if norms else None
    calls = []
    for _ in range(rounds):
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt)
        pos = torch.randint(0, 200_000, (t,), device=dev)
        kc = torch.empty(blocks, page, hkv, d, device=dev, dtype=dt)
        vc = torch.empty_like(kc)
        slots = torch.randperm(blocks * page, device=dev)[:t]
        calls.append(
            lambda qkv=qkv, pos=pos, kc=kc, vc=vc, slots=slots: rope_write_kv(
                qkv, pos, cos, sin, kc, vc, slots, hq, hkv, qn, kn, 1e-6, unit,
                chain=False, heads_per_program=split,
            )
        )  # fmt: skip
    return graph_time(calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows to FILE")
    args = parser.parse_args()
    rows = []
    print("model        tokens  one head µs  all heads µs  default")
    for name, shape in SHAPES.items():
        hq, hkv = shape[0], shape[1]
        for t in (1, 4, 32, 256, 4096):
            full = (hq, hkv)
            one = min(time_rope(shape, t, (1, 1)) for _ in range(2))
            whole = min(time_rope(shape, t, full) for _ in range(2))
            default = "one" if rope_heads_per_program(t, hq, hkv) == (1, 1) else "all"
            rows.append(dict(model=name, tokens=t, one_head_us=one, all_heads_us=whole,
                             default=default))  # fmt: skip
            print(f"{name:12} {t:6} {one:12.2f} {whole:13.2f}  {default}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
