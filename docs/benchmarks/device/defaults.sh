# The engine at its defaults on one GPU, one call: decode at batch 1 (dummy:gemma3-12b,
# dummy:qwen3-8b, dummy:llama3.1-8b at 4K / 32K / 128K), time to first token at 32K / 128K,
# and decode as a streaming HTTP client sees it (http_decode.sh). Issue 14's and 17's numbers
# as a user gets them with no options (on an H100: 128-token blocks, the auto prefill path).
#   run: bash docs/benchmarks/device/defaults.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress --max-num-seqs 1"
C="--context 4096,32768,131072"
step gemma 80 $B --model dummy:gemma3-12b --gpu-memory-utilization 0.93 $C --json "$OUT/gemma.json"
step qwen 60 $B --model dummy:qwen3-8b $C --json "$OUT/qwen.json"
step llama 60 $B --model dummy:llama3.1-8b $C --json "$OUT/llama.json"
step ttft 120 python3 -m flashserve bench prefill --model dummy:llama3.1-8b --tokens 32k,128k \
  --no-peer --rounds 2 --no-progress --json "$OUT/ttft.json"
step http 200 bash docs/benchmarks/device/http_decode.sh
for f in gemma qwen llama ttft http; do
  echo "== $f"; grep -E "^(context|tokens|[0-9])|tok/s|TTFT" "$OUT/$f.log" | head -12
done
pack
