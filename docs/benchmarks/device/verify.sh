# Every GPU test file, in four calls of under 10 minutes, on two GPUs where the machine has them
# (one: the same work, one group after the other, as far as the time goes; four: three calls,
# PHASE=kernels taking PHASE=more's groups on GPUs 2 and 3). The default model travels in halves
# (wheels.sh), so:
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
#   call 4: PHASE=tp bash docs/benchmarks/device/verify.sh        carry [".whl"]
#           the two TP files (two GPUs each): on two pairs at once where there are four GPUs,
#           else one after the other
# The groups are balanced by the times of 2026-11-27 (2x H200, docs/gpu-checks.md): kernels +
# layer kernels 290 s, gemv + fp8 kernels 164, prefix 51, prefill paths 64; and of 2026-11-28,
# with every CUDA engine's start-up warm-up: kernels + layer kernels 254, archs over 450 (22 of
# its 28 in 300 s on a fresh machine; the warm-up adds compiles, +50% of the Triton keys of a
# head-dim-256 case), engine 253, kv_fp8 263; and of session 33 (4x H200, a fresh machine):
# kernels + layer kernels 289, archs 402 (its slowest case 165 s), gemv + fp8 kernels over 200
# with a cold cache and 164 warm, engine 320, kv_fp8 314, bad input 30, fold + greedy 44, the TP
# files 268 and 266, each on its own pair; and of session 34 (2x H200, a fresh machine): archs
# 168, paths 43, bad input 42, model 92, prefix 22, engine 266, kv_fp8 290, the TP files 232
# and 227 one after the other, fold + greedy 40.
LIMIT=${LIMIT:-570}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -o faulthandler_timeout=240"
gpus=$(nvidia-smi -L | wc -l)
other=$(( gpus > 1 ? 1 : 0 ))
model_files() {
  step model 280 $P -m gpu tests/test_model_gpu.py tests/test_async_scheduling.py \
    tests/test_sampler.py tests/test_fp8_accuracy.py
}
bad_input() { step bad_input 240 $P -m gpu tests/test_bad_input.py; }
more_first() { model_files; bad_input; }
more_second() { step fold_greedy 300 $P tests/test_tp_fold.py tests/test_greedy_kernel.py; }
if [ "${PHASE:-}" = kernels ] && [ "$gpus" -ge 4 ]; then
  ( export CUDA_VISIBLE_DEVICES=0
    step kernels 300 $P tests/test_kernels_gpu.py tests/test_layer_kernels.py
    step prefix 70 $P -m gpu tests/test_prefix_cache.py
    step paths 100 $P -m gpu tests/test_prefill_paths_gpu.py
  ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1
    step archs 540 python3 -m pytest -q -o faulthandler_timeout=100 -m gpu tests/test_archs_gpu.py
  ) > "$OUT/second.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=2
    step gemv 300 $P -m gpu tests/test_gemv.py tests/test_fp8_kernels.py
    bad_input
  ) > "$OUT/third.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=3
    model_files
    more_second
  ) > "$OUT/fourth.txt" 2>&1 &
elif [ "${PHASE:-}" = kernels ]; then
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
  ( export CUDA_VISIBLE_DEVICES=0; more_first ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=$other; more_second ) > "$OUT/second.txt" 2>&1 &
elif [ "${PHASE:-}" = tp ] && [ "$gpus" -ge 4 ]; then
  ( export CUDA_VISIBLE_DEVICES=0,1; step tp 300 $P tests/test_tp_gpu.py ) > "$OUT/first.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=2,3; step tp_fold 300 $P tests/test_tp_fold_gpu.py
  ) > "$OUT/second.txt" 2>&1 &
elif [ "${PHASE:-}" = tp ]; then
  ( step tp 280 $P tests/test_tp_gpu.py; step tp_fold 280 $P tests/test_tp_fold_gpu.py
  ) > "$OUT/first.txt" 2>&1 &
else
  echo "PHASE must be kernels, engine, more or tp"; exit 2
fi
wait
cat "$OUT"/first.txt "$OUT"/second.txt "$OUT"/third.txt "$OUT"/fourth.txt 2> /dev/null
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -40
pack
