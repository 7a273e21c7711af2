# Issue 14 on one GPU, one call: the decode layer's kernels after a change (the gated GEMV,
# the RoPE kernel's head split), then bench decode end to end, this tree against an older one
# copied beside it (OLD, a directory; default .carry/old), alternated.
#   run: bash docs/benchmarks/device/layer.sh     carry: [".whl", ".carry/old"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
OLD=${OLD:-.carry/old}
step tests 150 python3 -m pytest -q -x tests/test_gemv.py tests/test_layer_kernels.py \
  tests/test_kernels_gpu.py -m "gpu or not gpu" -k "gated or rope or act or norm"
step rope 60 python3 docs/benchmarks/rope_split_bench.py --json "$OUT/rope.json"
step gated 60 python3 -m kernels.bench_gemv --gated
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress --max-num-seqs 1"
G="--model dummy:gemma3-12b --gpu-memory-utilization 0.93 --context 4096,32768"
L="--model dummy:llama3.1-8b --context 4096,32768"
Q="--model dummy:qwen3-8b --context 4096,32768"
step gemma_new 70 $B $G --json "$OUT/gemma-new.json"
(cd "$OLD" && step gemma_old 70 $B $G --json "$OUT/gemma-old.json")
step llama_new 50 $B $L --json "$OUT/llama-new.json"
(cd "$OLD" && step llama_old 50 $B $L --json "$OUT/llama-old.json")
step qwen_new 50 $B $Q --json "$OUT/qwen-new.json"
for f in rope gated gemma_new gemma_old llama_new llama_old qwen_new; do
  echo "== $f"; grep -E "^(model|context|[0-9a-z].* [0-9])" "$OUT/$f.log" | grep -v Warn | head -20
done
pack
