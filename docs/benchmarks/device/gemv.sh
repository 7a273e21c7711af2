# The GEMV's diag tiles (``linear_small_m(diag=True)``: x's rows as 8 / M chunks in the dot's
# 8 columns; built 2026-11-27, opt-in, never timed) against today's picks, one GPU, one call:
# the GPU tests of diag first, then bf16 (kernels.bench_gemv --diag) and fp8 per channel and
# blocks (kernels.bench_fp8 --sweep: every tile with and without diag) at M = 1 and 8.
#   run: bash docs/benchmarks/device/gemv.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
# (no marker filter: the diag cases written for the interpreter run on CUDA too, bf16 there)
step tests 150 python3 -m pytest -q tests/test_gemv.py tests/test_fp8_kernels.py \
  -k "diag or tile_kinds"
step bf16 120 python3 -m kernels.bench_gemv --diag --ms 1,8 --json "$OUT/bf16-diag.json"
S="python3 -m kernels.bench_fp8 --sweep --layouts fp8-channel"
step ch_m1 110 $S --ms 1 --shapes qkv,o_proj,down --json "$OUT/fp8-ch-m1.json"
step ch_m8 110 $S --ms 8 --shapes qkv,o_proj,down --json "$OUT/fp8-ch-m8.json"
step gate_up 90 $S --ms 1,8 --shapes gate_up --json "$OUT/fp8-ch-gate-up.json"
grep -E "^[a-z_]+ +[0-9]+ \|" "$OUT/bf16.log"
for f in ch_m1 ch_m8 gate_up; do
  echo "== $f"; grep -v '^  {' "$OUT/$f.log" | grep -E "^[a-z_]+ +[0-9]+ \|" | head -8
  grep '^  {' "$OUT/$f.log" | cut -c1-220
done
pack
