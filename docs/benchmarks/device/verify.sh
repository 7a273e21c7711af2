# Every GPU test file, in two calls of under 10 minutes, on two GPUs where the machine has them
# (one: the same work, one group after the other, as far as the time goes). The default model
# travels in halves (wheels.sh), so:
#   call 1: PHASE=kernels bash docs/benchmarks/device/verify.sh   carry [".whl", ".carry/gguf.1"]
#           the kernel tests (no model needed; the first half of the model unpacked meanwhile)
#   call 2: PHASE=engine bash docs/benchmarks/device/verify.sh    carry [".whl", ".carry/gguf.2"]
#           the engine tests (the default model, the architectures, prefix caching, fp8 pools,
#           the sm_90 prefill paths), on a warm machine that kept /tmp from call 1
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -o faulthandler_timeout=240"
other=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
if [ "${PHASE:-}" = kernels ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step kernels 540 $P tests/test_kernels_gpu.py tests/test_layer_kernels.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other
    step gemv 300 $P -m gpu tests/test_gemv.py tests/test_fp8_kernels.py
    step kv_fp8 240 $P tests/test_kv_fp8_gpu.py -k "not engine and not prefix"
  ) > "$OUT/second.txt" 2>&1 &
elif [ "${PHASE:-}" = engine ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step engine 240 $P -m gpu tests/test_engine_gpu.py
    step prefix 150 $P -m gpu tests/test_prefix_cache.py
    step paths 120 $P -m gpu tests/test_prefill_paths_gpu.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other
    step archs 360 $P -m gpu tests/test_archs_gpu.py
    step fp8_engine 180 $P tests/test_kv_fp8_gpu.py -k "engine or prefix"
  ) > "$OUT/second.txt" 2>&1 &
else
  echo "PHASE must be kernels or engine"; exit 2
fi
wait
cat "$OUT/first.txt" "$OUT/second.txt"
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -40
pack
