# Branch exp/fold-norm-early-loads (session 29): the norm kernels issue every load before their
# first store or atomic (x, the residual, the weights; folded, both slots' words beside the
# counter's add), where main's waited one round trip to L2 after another (its PTX: the weight
# loaded after the residual's store; folded, the words after the add, the residual after the
# spin); and the RoPE kernel loads the step's inputs (position, slot, the tables' rows) before
# its PDL wait, leaving one round trip after it where main's chained two. One call on two H200s (nvidia-h200-x2): TP=2 fused and TP=1 of this tree against
# main carried as .carry/base (`git archive main flashserve kernels | tar -x -C .carry/base`),
# alternated, then the norms' GPU tests and the fold's on two ranks.
#   run: TREE=<commit> bash docs/benchmarks/device/norm_loads.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b"
F="--tensor-parallel-size 2 --tp-all-reduce fused --context 32768,131072"
C="--context 4096,32768,131072"
BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
for r in a b; do
  step tp2_new_$r 60 $B $F --json "$OUT/tp2_new_$r.json"
  step tp2_base_$r 60 $BASE $B $F --json "$OUT/tp2_base_$r.json"
  CUDA_VISIBLE_DEVICES=0 step tp1_new_$r 50 $B $C --json "$OUT/tp1_new_$r.json"
  CUDA_VISIBLE_DEVICES=0 step tp1_base_$r 50 $BASE $B $C --json "$OUT/tp1_base_$r.json"
done
# on the GPU test_tp_fold.py runs its kernels in bf16 too (no gpu mark: every test of it)
step tests 200 python3 -m pytest -q tests/test_tp_fold.py tests/test_layer_kernels.py \
  tests/test_tp_fold_gpu.py tests/test_kernels_gpu.py -k "not fused_all_reduce and not prefill"
ms_steps tp2_new_a tp2_base_a tp1_new_a tp1_base_a tp2_new_b tp2_base_b tp1_new_b tp1_base_b
tail -2 "$OUT/tests.log"
pack
