# Issue 17 on one GPU, one call of under 10 minutes: the sm_90 prefill paths in the engine
# (test), the kernel table (4K / 16K beside SDPA), then time to first token at 32K and 128K on
# dummy:llama3.1-8b for portable at 16-token blocks (the default before 6176d53), hopper and gluon at 128,
# and decode at 128-token blocks (no regression from the larger page).
#   run: bash docs/benchmarks/device/prefill.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
step paths_test 120 python3 -m pytest -q -m gpu tests/test_prefill_paths_gpu.py
step kernels 90 python3 -m kernels.bench --batches "" --prefill 4096,16384 --json "$OUT/kb.json"
P="python3 -m flashserve bench prefill --model dummy:llama3.1-8b --tokens 32k,128k --no-peer \
--rounds 2 --no-progress"
step ttft_p16 110 $P --block-size 16 --prefill-path portable --json "$OUT/ttft-p16.json"
step ttft_gluon 100 $P --block-size 128 --prefill-path gluon --json "$OUT/ttft-gluon.json"
step ttft_hopper 100 $P --block-size 128 --prefill-path hopper --json "$OUT/ttft-hopper.json"
step decode_p128 60 python3 -m flashserve bench decode --model dummy:llama3.1-8b --batch 1 \
  --steps 32 --no-peer --no-progress --block-size 128 --context 4096,32768,131072
for f in kernels ttft_p16 ttft_gluon ttft_hopper decode_p128; do
  echo "== $f"; grep -E "^(tokens|context|[0-9]|prefill|  *[0-9])" "$OUT/$f.log" | head -12
done
pack
