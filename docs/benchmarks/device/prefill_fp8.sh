# Issue 17, point 2 on one GPU: the Hopper prefill path over an fp8 KV cache. Two calls of
# under 10 minutes each:
#   PHASE=check (default): its GPU tests (kernels: d 64/128/256, pages 64/128, window +
#     soft-cap, graph replay, auto's choice, every swept config; the engine's tokens and logits
#     against the portable path over the same fp8 cache), then the prefill table over an fp8
#     cache (portable p16/64/128 beside hopper p64/128; SDPA stays bf16);
#   PHASE=time: the Hopper tile sweep over an fp8 cache (HOPPER_CONFIGS + HOPPER_FP8_CONFIGS),
#     then time to first token at 32K / 128K on dummy:llama3.1-8b with an fp8 cache: portable
#     at 16-token blocks (the fp8 default before bb9a180) and 128, hopper at 128 (the default now).
#   run: PHASE=check bash docs/benchmarks/device/prefill_fp8.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
if [ "${PHASE:-check}" = check ]; then
  step tests 330 python3 -m pytest -q tests/test_kv_fp8_gpu.py -k "hopper or auto_takes or prefill_fp8"
  step paths_test 100 python3 -m pytest -q -m gpu tests/test_prefill_paths_gpu.py -k fp8
  step kernels 100 python3 -m kernels.bench --batches "" --prefill 4096,16384 --kv-dtype fp8 \
    --json "$OUT/kb-fp8.json"
  for f in tests paths_test kernels; do echo "== $f"; tail -8 "$OUT/$f.log"; done
else
  step sweep 250 python3 -m kernels.bench --sweep hopper --kv-dtype fp8 --json "$OUT/sweep-fp8.json"
  P="python3 -m flashserve bench prefill --model dummy:llama3.1-8b --tokens 32k,128k --no-peer \
--rounds 2 --no-progress --kv-cache-dtype fp8"
  step ttft_p16 110 $P --block-size 16 --json "$OUT/ttft-fp8-p16.json"
  step ttft_p128 100 $P --block-size 128 --prefill-path portable --json "$OUT/ttft-fp8-p128.json"
  step ttft_hopper 100 $P --block-size 128 --prefill-path hopper --json "$OUT/ttft-fp8-hopper.json"
  for f in sweep ttft_p16 ttft_p128 ttft_hopper; do
    echo "== $f"; grep -E "^(tokens|[0-9]|prefill|  *[0-9]|  hopper)" "$OUT/$f.log" | tail -24
  done
fi
pack
