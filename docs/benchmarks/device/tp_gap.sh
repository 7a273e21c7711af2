# Issue 18's gap to 1.7x on two GPUs (nvidia-h200-x2 / nvidia-h100-x2), one call: the decode
# kernel's tiles (`--sweep decode-config`; its 2026-11-27 run timed the stage rule that was
# deleted after it, with a `stages` sweep deleted too) and split counts at 128-token pages,
# for a TP=2 rank's heads (16/4, GPU 0) and for TP=1's (32/8, GPU 1; 128- and 16-token pages),
# both GPUs at once; then the step kernel by kernel at 32K and 128K (launch tables: each
# kernel alone, no PDL chain) on one GPU and on two with `--tp-all-reduce fused` (the engine's
# decode kernel at TP=2 / 128K took 74.4 us a layer where the same kernel alone took 67.2;
# once more with a small KV pool, to see whether the pool's size is why).
#   run: bash docs/benchmarks/device/tp_gap.sh     carry: [".whl"]
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
K="python3 -m kernels.bench --sweep decode-config"
P="1x4096,1x16384,1x32768,1x131072,8x4096,8x16384"
CUDA_VISIBLE_DEVICES=0 step tiles_16_4 200 $K,splits --page 128 --heads 16/4 \
  --points 1x32768,1x131072 --json "$OUT/tiles-16-4.json" &
CUDA_VISIBLE_DEVICES=1 step tiles_32_8 200 bash -c "$K --page 128 --points $P \
  --json $OUT/tiles-32-8-p128.json && $K --page 16 --points $P --json $OUT/tiles-32-8-p16.json" &
wait
B="python3 -m flashserve bench decode --batch 1 --steps 16 --no-peer --no-progress"
T="--model dummy:llama3.1-8b --context 32768,131072 --no-pdl-chain"
step tp2_fused_prof 110 $B $T --tensor-parallel-size 2 --tp-all-reduce fused --profile "$OUT/tp2f"
step tp1_prof 90 $B $T --profile "$OUT/tp1"
# is it the pool's size (pages spread over ~2 GB a layer: address translation)? the same at
# 128K alone with a pool of 256K tokens a rank
step tp2_small_pool 90 $B --model dummy:llama3.1-8b --context 131072 --no-pdl-chain \
  --tensor-parallel-size 2 --tp-all-reduce fused --max-kv-tokens 262144 --profile "$OUT/tp2s"
grep -h "^decode-config\|^splits" "$OUT"/tiles_*.log
for f in "$OUT"/*/*-launches.txt; do echo "== $f"; head -10 "$f" | cut -c1-120; done
find "$OUT" -mindepth 2 -name '*.json' -delete
pack
