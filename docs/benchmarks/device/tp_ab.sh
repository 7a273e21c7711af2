# Issue 18, one change at a time on two GPUs (nvidia-h200-x2 / nvidia-h100-x2), one call of
# under 10 minutes: TP=2 fused decode at batch 1 (contexts CTX) and TP=1 on GPU 0 (CTX1) of
# this tree against an older one carried as .carry/base (`git archive <base> flashserve
# kernels | tar -x -C .carry/base`), alternated twice, then the GPU tests TESTS (default: the
# TP engine tests). Session 23 ran an earlier form (TP=1 of this tree only) for the replicated
# embeddings; session 30 this one, then named norm_loads.sh, for the norms' loads first, with
# TESTS='python3 -m pytest -q tests/test_tp_fold.py tests/test_layer_kernels.py
# tests/test_tp_fold_gpu.py tests/test_kernels_gpu.py -k "not fused_all_reduce and not prefill"'.
#   run: TREE=<commit> bash docs/benchmarks/device/tp_ab.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b"
F="--tensor-parallel-size 2 --tp-all-reduce fused --context ${CTX:-32768,131072}"
C="--context ${CTX1:-4096,32768,131072}"
BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
for r in a b; do
  step tp2_new_$r 60 $B $F --json "$OUT/tp2_new_$r.json"
  step tp2_base_$r 60 $BASE $B $F --json "$OUT/tp2_base_$r.json"
  CUDA_VISIBLE_DEVICES=0 step tp1_new_$r 50 $B $C --json "$OUT/tp1_new_$r.json"
  CUDA_VISIBLE_DEVICES=0 step tp1_base_$r 50 $BASE $B $C --json "$OUT/tp1_base_$r.json"
done
step tests 200 bash -c "${TESTS:-python3 -m pytest -q -m gpu tests/test_tp_gpu.py}"
ms_steps tp2_new_a tp2_base_a tp1_new_a tp1_base_a tp2_new_b tp2_base_b tp1_new_b tp1_base_b
tail -2 "$OUT/tests.log"
pack
