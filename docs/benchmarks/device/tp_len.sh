# Issue 18: does a 32K step at TP=2 pay for its decode plan's 33rd split? Through HTTP (31,000
# tokens, max_model_len 40,000) TP=2 took 2.97 ms a token against bench decode's 3.17 at 32K.
# A rank's 4 KV heads at 32,768-32,800 tokens take 33 splits of 1,024 tokens, the last a sliver,
# whose merge takes a second chunk (32 splits a chunk); at 31,000 there are 31. Kernel alone
# (splits sweep at 16/4 heads, 128-token pages, GPU 1) at 31,000 / 32,768 / 32,800 tokens,
# and bench decode at 31,000 and 32,768 (one process each, one plan), TP=1 and TP=2 alternated.
#   run: TREE=<commit> bash docs/benchmarks/device/tp_len.sh   carry: [".whl"]
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
CUDA_VISIBLE_DEVICES=1 step splits 150 python3 -m kernels.bench --sweep splits --heads 16/4 \
  --page 128 --points 1x31000,1x32768,1x32800 --json "$OUT/splits.json" &
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b --context 31000,32768"
CUDA_VISIBLE_DEVICES=0 step tp1_a 60 $B --json "$OUT/tp1_a.json"
wait
F="--tensor-parallel-size 2 --tp-all-reduce fused"
step tp2_a 70 $B $F --json "$OUT/tp2_a.json"
CUDA_VISIBLE_DEVICES=0 step tp1_b 60 $B --json "$OUT/tp1_b.json"
step tp2_b 70 $B $F --json "$OUT/tp2_b.json"
ms_steps tp1_a tp2_a tp1_b tp2_b
grep -h "\"sweep\": \"splits\"" "$OUT/splits.log" | cut -c1-120 | head -40
pack
