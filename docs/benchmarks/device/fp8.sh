# Issue 15 on one GPU, one call a phase (docs/benchmarks/fp8.md says what each settles):
#   PHASE=gemv: the fp8 GEMV at the heuristic's tiles against bf16 (kernels.bench_fp8), then its
#     sweep (tiles, K splits) per layout and shape, per-channel scales first, as far as the
#     time goes; each config checked against float64 first; MS: the batch rows (default 1,8)
#   PHASE=e2e: bench decode of dummy:llama3.1-8b at batch 1, 4K / 32K / 128K: bf16, the fp8 KV
#     cache, fp8 weights + fp8 KV, then bf16 again (each its own process)
#   PHASE=tiles: the fp8 GEMV's GPU tests and its table at the heuristic's tiles, then e2e
#   PHASE=splits: the decode kernel's splits over an fp8 cache and a bf16 one at 4K / 16K, then
#     (fp8) its programs per SM at 1x128K, 8x16K, 32x16K (`kernels.bench --sweep per-sm`)
#   PHASE=accuracy: bench accuracy on the default model (bf16, Triton, CUDA graphs): fp8 KV,
#     fp8 weights and both against bf16 (fp8.md's CPU table, on the GPU); needs the model's two
#     halves: run it right after a call that carried .carry/gguf.1 (verify.sh PHASE=kernels),
#     carrying .carry/gguf.2
#   run: PHASE=gemv bash docs/benchmarks/device/fp8.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
if [ "${PHASE:-}" = gemv ]; then
  step pick 90 python3 -m kernels.bench_fp8 --ms "${MS:-1,8}" --json "$OUT/fp8-gemv-pick.json"
  S="python3 -m kernels.bench_fp8 --sweep --ms ${MS:-1,8}"
  step ch1 120 $S --layouts fp8-channel --shapes qkv,o_proj --json "$OUT/sweep-ch-1.json"
  step ch2 120 $S --layouts fp8-channel --shapes gate_up,down --json "$OUT/sweep-ch-2.json"
  step blk1 120 $S --layouts fp8-block --shapes qkv,o_proj --json "$OUT/sweep-blk-1.json"
  step blk2 120 $S --layouts fp8-block --shapes gate_up,down --json "$OUT/sweep-blk-2.json"
  for f in pick ch1 ch2 blk1 blk2; do
    echo "== $f"; grep -v '^  {' "$OUT/$f.log" | grep -E "^[a-z_]+ +[0-9]+ \||copy" | head -12
  done
elif [ "${PHASE:-}" = e2e ] || [ "${PHASE:-}" = tiles ]; then
  if [ "$PHASE" = tiles ]; then  # the GEMV tiles first: their GPU tests, then their table
    step tests 170 python3 -m pytest -q -m gpu tests/test_fp8_kernels.py -k gemv
    step pick 60 python3 -m kernels.bench_fp8 --json "$OUT/fp8-gemv-pick.json"
  fi
  B="python3 -m flashserve bench decode --model dummy:llama3.1-8b --batch 1 --steps 32 --no-peer"
  B="$B --no-progress --max-num-seqs 1 --context 4096,32768,131072"
  step bf16 70 $B --json "$OUT/bf16.json"
  step kv_fp8 70 $B --kv-cache-dtype fp8 --json "$OUT/kv_fp8.json"
  step w_kv_fp8 90 $B --kv-cache-dtype fp8 --quantization fp8 --json "$OUT/w_kv_fp8.json"
  step bf16_again 70 $B --json "$OUT/bf16_again.json"
  [ "$PHASE" = tiles ] && grep -E "^[a-z_]+ +[0-9]+ \||copy" "$OUT/pick.log"
  for f in bf16 kv_fp8 w_kv_fp8 bf16_again; do echo "== $f"; grep -E "^[0-9]" "$OUT/$f.log"; done
elif [ "${PHASE:-}" = splits ]; then  # the decode kernel's split count over an fp8 cache at
  # short contexts (the heuristic's min_split_tokens is bf16's, measured on 64-token tiles)
  K="python3 -m kernels.bench --sweep splits --points 1x4096,1x16384,8x4096"
  step splits_fp8 200 $K --kv-dtype fp8 --json "$OUT/splits-fp8.json"
  step splits_bf16 150 $K --json "$OUT/splits-bf16.json"
  # programs an SM at the reads of >= 256 MB (the fp8-KV kernel: 83% of copy at 1x128K)
  P="python3 -m kernels.bench --sweep per-sm --points 1x131072,8x16384,32x16384"
  step per_sm_fp8 150 $P --kv-dtype fp8 --json "$OUT/per-sm-fp8.json"
  for f in splits_fp8 splits_bf16 per_sm_fp8; do
    echo "== $f"; grep -v '^  {' "$OUT/$f.log" | tail -25
  done
elif [ "${PHASE:-}" = accuracy ]; then
  A="python3 -m flashserve bench accuracy --max-kv-tokens 65536"  # (a pool of all free memory
  # per engine would be ~70 GB for a 135M model: slow to build, twice a setting)
  step acc_kv 150 $A --kv-cache-dtype fp8 --json "$OUT/acc-kv.json"
  step acc_w 150 $A --quantization fp8 --json "$OUT/acc-w.json"
  step acc_both 150 $A --kv-cache-dtype fp8 --quantization fp8 --json "$OUT/acc-both.json"
  for f in acc_kv acc_w acc_both; do echo "== $f"; tail -12 "$OUT/$f.log"; done
else
  echo "PHASE must be gemv, e2e, tiles, splits or accuracy"; exit 2
fi
pack
