# The GEMV's diag tiles (``linear_small_m(diag=True)``: x's rows as 8 / M chunks in the dot's
# 8 columns; built 2026-11-27, never timed; off by default: ``_DIAG_UP_TO_M = 0``), one GPU:
#   PHASE=kernels: the GPU tests of diag first, then bf16 (kernels.bench_gemv --diag) and fp8
#     per channel (kernels.bench_fp8 --sweep: every tile with and without diag) at M = 1 and 8
#   PHASE=e2e: bench decode of this tree against a copy with diag up to M = 8, alternated,
#     dummy:llama3.1-8b at 4K / 32K / 128K: bf16 at batch 1 and 8, fp8 weights + KV at batch 1
#   run: PHASE=kernels bash docs/benchmarks/device/gemv.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
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
  rm -rf /tmp/diag && mkdir -p /tmp/diag && cp -r kernels flashserve server /tmp/diag/
  sed -i 's/^_DIAG_UP_TO_M = 0$/_DIAG_UP_TO_M = 8/' /tmp/diag/kernels/gemv.py
  grep -q "^_DIAG_UP_TO_M = 8$" /tmp/diag/kernels/gemv.py || { echo "sed missed"; exit 2; }
  B="python3 -m flashserve bench decode --model dummy:llama3.1-8b --steps 32 --no-peer"
  B="$B --no-progress --context 4096,32768,131072"
  # "on": the copy, run from its own folder (python -m puts the working directory first on
  # sys.path, before PYTHONPATH's /tmp/site and this tree)
  for r in 1 2; do
    step off_b1_$r 60 $B --batch 1 --max-num-seqs 1 --json "$OUT/off-b1-$r.json"
    step on_b1_$r 60 bash -c "cd /tmp/diag && $B --batch 1 --max-num-seqs 1 --json $OUT/on-b1-$r.json"
  done
  step off_b8 60 $B --batch 8 --context 4096,32768 --json "$OUT/off-b8.json"
  step on_b8 60 bash -c "cd /tmp/diag && $B --batch 8 --context 4096,32768 --json $OUT/on-b8.json"
  F="--kv-cache-dtype fp8 --quantization fp8 --batch 1 --max-num-seqs 1"
  step off_fp8 60 $B $F --json "$OUT/off-fp8.json"
  step on_fp8 60 bash -c "cd /tmp/diag && $B $F --json $OUT/on-fp8.json"
  for f in off_b1_1 on_b1_1 off_b1_2 on_b1_2 off_b8 on_b8 off_fp8 on_fp8; do
    echo "== $f"; grep -E "^[0-9]" "$OUT/$f.log"
  done
else
  echo "PHASE must be kernels or e2e"; exit 2
fi
pack
