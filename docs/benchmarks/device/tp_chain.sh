# Issue 18: where the PDL chain leaves time at TP=2. The step at 32K profiled (rank 0's launch
# table and trace) with and without the chain, TP=2 fused on both GPUs, then TP=1 on GPU 0
# while GPU 1 runs the decode, RoPE and norm kernels' GPU tests; then decode through the HTTP
# server (http_decode.sh) at TP=2 fused and at TP=1.
#   run: TREE=<commit> bash docs/benchmarks/device/tp_chain.sh   carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 16 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b --context 32768"
F="--tensor-parallel-size 2 --tp-all-reduce fused"
step tp2_chain 90 $B $F --profile "$OUT/tp2c" --json "$OUT/tp2_chain.json"
step tp2_nochain 90 $B $F --no-pdl-chain --profile "$OUT/tp2n" --json "$OUT/tp2_nochain.json"
CUDA_VISIBLE_DEVICES=1 step tests 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
  tests/test_layer_kernels.py -k "decode or rope or norm" &
CUDA_VISIBLE_DEVICES=0 step tp1_chain 80 $B --profile "$OUT/tp1c" --json "$OUT/tp1_chain.json"
CUDA_VISIBLE_DEVICES=0 step tp1_nochain 80 $B --no-pdl-chain --profile "$OUT/tp1n" \
  --json "$OUT/tp1_nochain.json"
wait
step http_tp2 130 bash docs/benchmarks/device/http_decode.sh $F
CUDA_VISIBLE_DEVICES=0 step http_tp1 110 bash docs/benchmarks/device/http_decode.sh
ms_steps tp2_chain tp2_nochain tp1_chain tp1_nochain
grep -h "tok/s\|tracebacks" "$OUT"/http_*.log | head -8
tail -1 "$OUT/tests.log"
for f in "$OUT"/*/*-launches.txt; do echo "== $f"; head -14 "$f" | cut -c1-110; done
find "$OUT" -mindepth 2 -name '*.json' ! -path '*tp2c*' -delete
pack
