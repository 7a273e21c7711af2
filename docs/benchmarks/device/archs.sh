# Issue 14's GPU tests (tests/test_archs_gpu.py: 7 tiny checkpoints x eager/graphs x fp32/bf16,
# each compiling its own kernels), split over two GPUs; a test past 150 s dumps its stacks.
#   run: bash docs/benchmarks/device/archs.sh     carry: [".whl"]
LIMIT=${LIMIT:-560}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -m gpu -o faulthandler_timeout=150 tests/test_archs_gpu.py"
( CUDA_VISIBLE_DEVICES=0 step archs_a 540 $P -k "qwen3 or mistral or gemma2" ) &
( CUDA_VISIBLE_DEVICES=$(( $(nvidia-smi -L | wc -l) > 1 ? 1 : 0 )) \
  step archs_b 540 $P -k "gemma3 or phi3" ) &
wait
pack
