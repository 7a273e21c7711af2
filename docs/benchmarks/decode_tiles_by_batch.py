"""Stage 1's tiles by batch: the decode kernel alone with a tuning's plan against the same plan
on other tiles, Llama-3-8B heads (32/8, head dim 128) on 128-token pages, under CUDA-graph replay
with the KV rotated over copies larger than L2 (``kernels.bench.time_ours``), µs a call. Session
29 ran it for ``DecodeTuning.few_rows_tiles`` (docs/benchmarks/decode.md):

    python3 docs/benchmarks/decode_tiles_by_batch.py [--tiles 128,4,3] [--heads 32/8] [--json FILE]

Each point times the default plan (``DecodeTuning()``, i.e. ``DEFAULT_DECODE_TUNING``'s, on
every GPU) twice, around the given tiles (``DecodeTuning(tiles=...)``: the split heuristic
then counts their programs an SM).
"""

from __future__ import annotations

import argparse
import json

from kernels.bench import attempt, time_ours
from kernels.decode import DecodeTuning

POINTS = [(1, 4096), (1, 32768), (1, 131072), (2, 32768), (4, 32768), (8, 16384),
          (16, 32768), (32, 4096), (16, 4096)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiles", default="128,4,3", help="BLOCK_N,num_warps,num_stages")
    ap.add_argument("--heads", default="32/8", help="query/KV heads")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    tiles = tuple(int(v) for v in args.tiles.split(","))
    hq, hkv = (int(v) for v in args.heads.split("/"))
    rows = []
    for bsz, ctx in POINTS:
        row = {"batch": bsz, "context": ctx, "rows": bsz * hkv}
        for name, tuning in (("default", DecodeTuning()), (args.tiles, DecodeTuning(tiles=tiles)),
                             ("default again", DecodeTuning())):  # fmt: skip
            row[name] = attempt(time_ours, bsz, ctx, page=128, hq=hq, hkv=hkv, tuning=tuning)
        rows.append(row)
        print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
