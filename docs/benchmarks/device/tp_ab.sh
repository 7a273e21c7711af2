# Issue 18, one change at a time on two GPUs (nvidia-h200-x2 / nvidia-h100-x2), one call of
# under 10 minutes: TP=2 fused decode at batch 1 of this tree against an older one carried as
# .carry/base (`git archive <base> flashserve kernels | tar -x -C .carry/base`), alternated,
# TP=1 of this tree once between them (the ratio's denominator, in the same call), then the TP
# GPU tests. Session 23 ran it for the replicated embeddings (tensor-parallel.md).
#   run: TREE=<commit> bash docs/benchmarks/device/tp_ab.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b --context ${CTX:-32768,131072}"
F="--tensor-parallel-size 2 --tp-all-reduce fused"
BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
step tp2_base_a 85 $BASE $B $F --json "$OUT/tp2_base_a.json"
step tp2_new_a 85 $B $F --json "$OUT/tp2_new_a.json"
step tp1 80 $B --json "$OUT/tp1.json"
step tp2_base_b 85 $BASE $B $F --json "$OUT/tp2_base_b.json"
step tp2_new_b 85 $B $F --json "$OUT/tp2_new_b.json"
step tp_tests 170 python3 -m pytest -q -m gpu tests/test_tp_gpu.py
ms_steps tp2_base_a tp2_new_a tp1 tp2_base_b tp2_new_b
tail -2 "$OUT/tp_tests.log"
pack
