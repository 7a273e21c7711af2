# Issue 17: time to first token of one prompt (dummy:llama3.1-8b, 32K and 128K tokens) at the
# default per-step token budget (--max-num-batched-tokens 2048: 16 and 64 prefill steps) and
# at larger ones (vLLM's server takes 8,192 on an H100, SGLang's chunked prefill 8,192-16,384),
# then decode at batch 1 in the largest one's process shape (the KV pool it leaves). One GPU,
# one call; each budget its own process.
#   run: bash docs/benchmarks/device/ttft_chunks.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
T="python3 -m flashserve bench prefill --model dummy:llama3.1-8b --tokens 32k,128k --no-peer"
T="$T --rounds 2 --no-progress"
for n in ${BUDGETS:-2048 8192 16384 32768}; do
  step ttft_$n 110 $T --max-num-batched-tokens $n --json "$OUT/ttft-$n.json"
done
step decode_32768 70 python3 -m flashserve bench decode --model dummy:llama3.1-8b --batch 1 \
  --steps 32 --no-peer --no-progress --max-num-seqs 1 --context 4096,131072 \
  --max-num-batched-tokens 32768 --json "$OUT/decode-32768.json"
for n in ${BUDGETS:-2048 8192 16384 32768}; do
  echo "== $n"; grep -E "^(tokens|[0-9])" "$OUT/ttft_$n.log" | head -4
done
echo "== decode at 32768"; grep -E "^[0-9]" "$OUT/decode_32768.log"
pack
