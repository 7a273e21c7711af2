# GGUF loading on the GPU (load.md, session 39): the dequantization's GPU tests, its rates
# (gguf_dequant_bench.py), then an 8B Q4_K file's load_model on CUDA, this tree around one run
# of an older tree's loader carried as .carry/old (`git archive <commit> flashserve kernels |
# tar -x -C .carry/old`). Carry [".whl", ".carry/old"]; about 140 s on a fresh H100.
LIMIT=${LIMIT:-250}
source docs/benchmarks/device/setup.sh
step quants 60 python3 -m pytest -q -o faulthandler_timeout=55 -m gpu tests/test_gguf_quants.py
step dequant 60 python3 docs/benchmarks/gguf_dequant_bench.py --json $OUT/gguf-dequant.json
tail -12 $OUT/dequant.log
step write 60 python3 docs/benchmarks/gguf_load_bench.py write /tmp/l8b.gguf
ls -la /tmp/l8b.gguf
B=docs/benchmarks/gguf_load_bench.py
step new_a 40 python3 $B load /tmp/l8b.gguf
step old_a 100 env PYTHONPATH=$PWD/.carry/old:$PYTHONPATH python3 $B load /tmp/l8b.gguf
step new_b 40 python3 $B load /tmp/l8b.gguf
grep -h load_model $OUT/new_*.log $OUT/old_*.log
