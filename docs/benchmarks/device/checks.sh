# The GPU tests that have not run since the last kernel changes, on one GPU or two (the second
# takes half of them; prefix caching's on the first), one call: two calls when the default model travels in halves
# (wheels.sh): carry [".whl", ".carry/gguf.1"] with ONLY_MODEL=1 first (it only unpacks), then
# [".whl", ".carry/gguf.2"].
#   run: bash docs/benchmarks/device/checks.sh
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
[ -n "${ONLY_MODEL:-}" ] && { echo "first half of the model in /tmp/model"; exit 0; }
second=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
( export CUDA_VISIBLE_DEVICES=$second
  step gluon 120 python3 -m pytest -q tests/test_kernels_gpu.py -k gluon
  step fp8_engine 240 python3 -m pytest -q tests/test_kv_fp8_gpu.py -k "engine or prefix"
  step archs 300 python3 -m pytest -q -m gpu tests/test_archs_gpu.py
) > "$OUT/second.txt" 2>&1 &
( export CUDA_VISIBLE_DEVICES=0
  step engine 300 python3 -m pytest -q -m gpu tests/test_engine_gpu.py
  step prefix 150 python3 -m pytest -q -m gpu tests/test_prefix_cache.py
) > "$OUT/first.txt" 2>&1 &
wait
cat "$OUT/first.txt" "$OUT/second.txt"
pack
