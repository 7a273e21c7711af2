# The GEMV's diag tiles (``linear_small_m(diag=True)``: x's rows as 8 / M chunks in the dot's
# 8 columns; gemv_config's pick for fp8 at M = 1 and bf16 at M = 2-8 since 2026-11-27), one GPU:
#   PHASE=kernels: the GPU tests of diag first, then bf16 (kernels.bench_gemv --diag) and fp8
#     per channel (kernels.bench_fp8 --sweep: every tile with and without diag) at M = 1 and 8
#   PHASE=e2e: bench decode of this tree against an older one (OLD, default .carry/old: the
#     tree before diag), alternated, dummy:llama3.1-8b: fp8 weights + KV at batch 1 (4K / 32K / 128K,
#     twice), bf16 at batch 8 (4K / 32K)
#   run: PHASE=kernels bash docs/benchmarks/device/gemv.sh     carry: [".whl"]
#        PHASE=e2e bash docs/benchmarks/device/gemv.sh         carry: [".whl", ".carry/old"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
OLD=${OLD:-.carry/old}
if [ "${PHASE:-}" = kernels ]; then
  # (no marker filter: the diag cases written for the interpreter run on CUDA too, bf16 there)
  step tests 150 python3 -m pytest -q tests/test_gemv.py tests/test_fp8_kernels.py \
    -k "diag or tile_kinds"
  step bf16 120 python3 -m kernels.bench_gemv --diag --ms 1,8 --json "$OUT/bf16-diag.json"
  S="python3 -m kernels.bench_fp8 --sweep --layouts fp8-channel"
  step ch_m1 110 $S --ms 1 --shapes qkv,o_proj,down --json "$OUT/fp8-ch-m1.json"
  step ch_m8 110 $S --ms 8 --shapes qkv,o_proj,down --json "$OUT/fp8-ch-m8.json"
  step gate_up 80 $S --ms 1,8 --shapes gate_up --json "$OUT/fp8-ch-gate-up.json"
  grep -E "^[a-z_]+ +[0-9]+ \|" "$OUT/bf16.log"
  for f in ch_m1 ch_m8 gate_up; do
    echo "== $f"; grep '^  {' "$OUT/$f.log" | cut -c1-220
  done
elif [ "${PHASE:-}" = e2e ]; then
  B="python3 -m flashserve bench decode --model dummy:llama3.1-8b --steps 32 --no-peer"
  B="$B --no-progress"
  F="--kv-cache-dtype fp8 --quantization fp8 --batch 1 --max-num-seqs 1"
  F="$F --context 4096,32768,131072"
  # "old": the tree before diag was the default, run from its own folder (python -m puts the
  # working directory first on sys.path, before PYTHONPATH's /tmp/site and this tree)
  step new_fp8_1 85 $B $F --json "$OUT/new-fp8-1.json"
  step old_fp8_1 85 bash -c "cd $OLD && $B $F --json $OUT/old-fp8-1.json"
  step new_b8 60 $B --batch 8 --context 4096,32768 --json "$OUT/new-b8.json"
  step old_b8 60 bash -c "cd $OLD && $B --batch 8 --context 4096,32768 --json $OUT/old-b8.json"
  step new_fp8_2 85 $B $F --json "$OUT/new-fp8-2.json"
  step old_fp8_2 85 bash -c "cd $OLD && $B $F --json $OUT/old-fp8-2.json"
  for f in new_fp8_1 old_fp8_1 new_b8 old_b8 new_fp8_2 old_fp8_2; do
    echo "== $f"; grep -E "^[0-9]" "$OUT/$f.log"
  done
else
  echo "PHASE must be kernels or e2e"; exit 2
fi
pack
