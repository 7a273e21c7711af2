# The start-up warm-up (EngineConfig.warm_up, on CUDA): the first request's time to first token
# through the HTTP server (http_decode.sh: three requests of 31,000 prompt tokens, one at a
# time; the slowest, p99, is the first), this tree against one without the warm-up carried as
# .carry/base (`git archive <rev> flashserve kernels server docs/benchmarks/device | tar -x -C
# .carry/base`). Order: base at TP=2 fused on the fresh machine (Triton's cache cold), this
# tree at TP=2, base at TP=2 again (Triton's cache warm: what is left is the ranks' own lazy
# set-up), this tree at TP=1 (GPU 0). The warm-up's own time is in the servers' logs.
#   run: TREE=<commit> bash docs/benchmarks/device/warmup.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
F="--tensor-parallel-size 2 --tp-all-reduce fused"
H=docs/benchmarks/device/http_decode.sh
BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
step base_tp2_cold 150 $BASE bash $H $F
step new_tp2 130 bash $H $F
step base_tp2_warm 130 $BASE bash $H $F
CUDA_VISIBLE_DEVICES=0 step new_tp1 110 bash $H
for s in base_tp2_cold new_tp2 base_tp2_warm new_tp1; do
  echo "== $s"; grep -h "time to first\|decode tokens/s\|requests:" "$OUT/$s.log"
done
grep -h "warm-up:\|captured" "$OUT"/server-*.log
pack
