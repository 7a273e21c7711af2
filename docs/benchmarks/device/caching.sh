# Issue 16 on one GPU (the first of a multi-GPU machine), one call of under 10 minutes: what
# prefix caching costs prompts that share nothing, over alternated pairs of servers
# (docs/benchmarks/caching_overhead_bench.py; a server's startup, warm-up and two timed runs
# take about 80 s on dummy:llama3.1-8b).
#   run: bash docs/benchmarks/device/caching.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
export CUDA_VISIBLE_DEVICES=0
step caching 570 python3 docs/benchmarks/caching_overhead_bench.py --pairs ${PAIRS:-3} --runs 2 \
  --server-args "--model dummy:llama3.1-8b" --json "$OUT/caching.json"
tail -12 "$OUT/caching.log"
pack
