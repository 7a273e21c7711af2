# The GEMV's diag tiles (``linear_small_m(diag=True)``: x's rows as 8 / M chunks in the dot's
# 8 columns; gemv_config's pick for fp8 per channel at M = 1 and bf16 at M = 2-8), one GPU:
#   PHASE=kernels: kernels.bench_fp8 --sweep (every tile with and without diag) where no sweep
#     ran yet: per channel at M = 8, block scales at M = 1 and 8
#   PHASE=e2e: bench decode of this tree against an older one (OLD, default .carry/old: the
#     tree before diag), alternated, dummy:llama3.1-8b: fp8 weights + KV at batch 1 (4K / 32K / 128K,
#     twice), bf16 at batch 8 (4K / 32K)
#   run: PHASE=kernels bash docs/benchmarks/device/gemv.sh     carry: [".whl"]
#        PHASE=e2e bash docs/benchmarks/device/gemv.sh         carry: [".whl", ".carry/old"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
OLD=${OLD:-.carry/old}
if [ "${PHASE:-}" = kernels ]; then  # what the 2026-11-27 calls left unswept (their tests'
  # compiles took the time: the tests are verify.sh's): fp8 at M = 8, and block scales at M = 1
  S="python3 -m kernels.bench_fp8 --sweep"
  step ch_m8 200 $S --layouts fp8-channel --ms 8 --shapes qkv,o_proj,down,gate_up \
    --json "$OUT/fp8-ch-m8.json"
  step blk_m1 170 $S --layouts fp8-block --ms 1 --shapes qkv,o_proj,down --json "$OUT/fp8-blk-m1.json"
  step blk_m8 170 $S --layouts fp8-block --ms 8 --shapes qkv,o_proj,down --json "$OUT/fp8-blk-m8.json"
  for f in ch_m8 blk_m1 blk_m8; do
    echo "== $f"; grep -v '^  {' "$OUT/$f.log" | grep -E "^[a-z_]+ +[0-9]+ \||copy"
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
