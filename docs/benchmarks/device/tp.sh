# Issue 18 on two GPUs (nvidia-h200-x2 / nvidia-h100-x2), one call of under 10 minutes:
# the TP GPU tests (the one-shot all-reduce's among them), then decode at batch 1 on one GPU,
# on two with NCCL and on two with --tp-all-reduce auto, then the 70B on two; then decode as a
# streaming HTTP client sees it at 31K context, one GPU and two.
#   run: bash docs/benchmarks/device/tp.sh     carry: [".whl"]
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
step tp_tests 240 python3 -m pytest -q -m gpu tests/test_tp_gpu.py
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
E="--model dummy:llama3.1-8b --context 32768,131072"
step tp1 75 $B $E --json "$OUT/tp1.json"
step tp2_nccl 80 $B $E --tensor-parallel-size 2 --json "$OUT/tp2_nccl.json"
step tp2_auto 80 $B $E --tensor-parallel-size 2 --tp-all-reduce auto --json "$OUT/tp2_auto.json"
step tp2_70b 90 $B --model dummy:llama3.1-70b --context 32768 --tensor-parallel-size 2 \
  --tp-all-reduce auto --gpu-memory-utilization 0.95 --json "$OUT/tp2_70b.json"
H="bash docs/benchmarks/device/http_decode.sh"
step http_tp1 100 $H
step http_tp2 120 $H --tensor-parallel-size 2 --tp-all-reduce auto
grep -h "tok/s\|inter-token\|decode" "$OUT"/http_tp*.log | head -12
for f in tp1 tp2_nccl tp2_auto tp2_70b; do
  echo "== $f"; grep -A3 "^context" "$OUT/$f.log"; grep -i "all-reduce\|roofline includes\|Error" "$OUT/$f.log" | head -4
done
pack
