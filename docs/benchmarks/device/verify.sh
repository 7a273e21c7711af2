# Every GPU test file, in three calls of under 10 minutes, on two GPUs where the machine has them
# (one: the same work, one group after the other, as far as the time goes). The default model
# travels in halves (wheels.sh), so:
#   call 1: PHASE=kernels bash docs/benchmarks/device/verify.sh   carry [".whl", ".carry/gguf.1"]
#           the tests that need no default model: the kernels, the architectures' engines
#           (tiny checkpoints), prefix caching, the sm_90 prefill paths (the first half of
#           the model unpacked meanwhile)
#   call 2: PHASE=engine bash docs/benchmarks/device/verify.sh    carry [".whl", ".carry/gguf.2"]
#           the default model's engine tests and the fp8 cache's, on a warm machine that kept
#           /tmp from call 1
#   call 3: PHASE=more bash docs/benchmarks/device/verify.sh      carry [".whl"]
#           the other files with GPU cases (tiny models, no default model): the model on
#           CUDA, async scheduling, the sampler, fp8 accuracy, bad input against a CUDA
#           server, the greedy kernel, the folded all-reduce's kernels on one GPU
# The groups are balanced by the times of 2026-11-27 (2x H200, docs/gpu-checks.md): kernels +
# layer kernels 290 s, gemv + fp8 kernels 164, prefix 51, prefill paths 64; and of 2026-11-28,
# with every CUDA engine's start-up warm-up: kernels + layer kernels 254, archs over 450 (22 of
# its 28 in 300 s on a fresh machine; the warm-up adds compiles, +50% of the Triton keys of a
# head-dim-256 case), engine 253, kv_fp8 263.
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -o faulthandler_timeout=240"
other=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 ))
if [ "${PHASE:-}" = kernels ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step kernels 300 $P tests/test_kernels_gpu.py tests/test_layer_kernels.py
    step gemv 200 $P -m gpu tests/test_gemv.py tests/test_fp8_kernels.py
    step prefix 70 $P -m gpu tests/test_prefix_cache.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other
    step archs 470 $P -m gpu tests/test_archs_gpu.py
    step paths 90 $P -m gpu tests/test_prefill_paths_gpu.py
  ) > "$OUT/second.txt" 2>&1 &
elif [ "${PHASE:-}" = engine ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step engine 560 $P -m gpu tests/test_engine_gpu.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other
    step kv_fp8 560 $P tests/test_kv_fp8_gpu.py
  ) > "$OUT/second.txt" 2>&1 &
elif [ "${PHASE:-}" = more ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step model 280 $P -m gpu tests/test_model_gpu.py tests/test_async_scheduling.py \
      tests/test_sampler.py tests/test_fp8_accuracy.py
    step bad_input 240 $P -m gpu tests/test_bad_input.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other
    step fold_greedy 300 $P tests/test_tp_fold.py tests/test_greedy_kernel.py
  ) > "$OUT/second.txt" 2>&1 &
else
  echo "PHASE must be kernels, engine or more"; exit 2
fi
wait
cat "$OUT/first.txt" "$OUT/second.txt"
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -40
pack
