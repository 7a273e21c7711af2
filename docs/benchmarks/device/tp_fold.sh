# Issue 18 on two GPUs (nvidia-h200-x2 / nvidia-h100-x2), one call of under 10 minutes:
# --tp-all-reduce fused (the all-reduce folded into the row-parallel GEMV and the norm after
# it: kernels/fold.py). First its kernels on two ranks (sums equal to NCCL's, a rank held back,
# CUDA graphs), then decode at batch 1 on one GPU and on two with nccl / auto / fused, then
# the engine's tokens with the fold against NCCL's (Qwen2 and Gemma 3, eager and graphs).
#   run: bash docs/benchmarks/device/tp_fold.sh     carry: [".whl"]
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -m gpu tests/test_tp_fold_gpu.py"
step fold_kernels 150 $P -k folded_kernels
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
E="--model dummy:llama3.1-8b --context 32768,131072"
step tp1 75 $B $E --json "$OUT/tp1.json"
step tp2_nccl 80 $B $E --tensor-parallel-size 2 --json "$OUT/tp2_nccl.json"
step tp2_auto 80 $B $E --tensor-parallel-size 2 --tp-all-reduce auto --json "$OUT/tp2_auto.json"
step tp2_fused 80 $B $E --tensor-parallel-size 2 --tp-all-reduce fused --json "$OUT/tp2_fused.json"
step fold_engine 330 $P -k tokens
for f in tp1 tp2_nccl tp2_auto tp2_fused; do
  echo "== $f"; grep -A3 "^context" "$OUT/$f.log"; grep -i "all-reduce\|Error" "$OUT/$f.log" | head -4
done
grep -h "passed\|failed\|assert\|Error" "$OUT"/fold_*.log | tail -8
pack
