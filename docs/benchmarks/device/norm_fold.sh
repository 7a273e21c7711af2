# Session 25's open question and checks (docs/benchmarks/fp8.md, session 25): the norm fold's
# producing GEMV over fp8 weights (o_proj, down: the residual add and tile sums in the epilogue)
# ran 41-45% longer alone with the same K loop in the compile report.
#   PHASE=ncu: Nsight Compute on fp8 o_proj and down, the third plain launch against the third
#     with the fold's part (docs/benchmarks/gemv_norm_bench.py --once), then the same for bf16
#     o_proj; then the GEMVs alone (gemv_norm_bench.py)
#   PHASE=verify: the fold's GPU tests, then bench decode of this tree against .carry/base
#     (bf16, and fp8 weights + cache, where the fold is off) at 4K / 32K / 128K
#   run: PHASE=ncu bash docs/benchmarks/device/norm_fold.sh     carry: [".whl"] (verify: and
#     ".carry/base", a tree from `git archive <rev> flashserve kernels`)
source docs/benchmarks/device/setup.sh
if [ "${PHASE:-}" = ncu ]; then
  S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats"
  for what in fp8:o_proj fp8:down bf16:o_proj; do
    for skip in 2 5; do
      step "ncu-${what/:/-}-$skip" 90 ncu -k regex:_linear_kernel --launch-skip $skip --launch-count 1 $S \
        python3 docs/benchmarks/gemv_norm_bench.py --once $what
    done
  done
  step micro 120 python3 docs/benchmarks/gemv_norm_bench.py --json $OUT/micro.json
  for f in $OUT/ncu-*.log; do echo "== $(basename $f)"; grep -E "Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit|Waves Per SM|Memory Throughput" $f | head -9; done
  grep -v Warn $OUT/micro.log
elif [ "${PHASE:-}" = verify ]; then
  step tests 200 python3 -m pytest -q -m gpu tests/test_gemv_norm.py tests/test_model_gpu.py
  B="python3 -m flashserve bench decode --model dummy:llama3.1-8b --batch 1 --steps 32 --no-peer --no-progress --max-num-seqs 1 --context 4096,32768,131072"
  BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
  F="--kv-cache-dtype fp8 --quantization fp8"
  step new_bf16 60 $B --json $OUT/new_bf16.json
  step base_bf16 60 $BASE $B --json $OUT/base_bf16.json
  step new_fp8 70 $B $F --json $OUT/new_fp8.json
  step base_fp8 70 $BASE $B $F --json $OUT/base_fp8.json
  for f in new_bf16 base_bf16 new_fp8 base_fp8; do echo "== $f"; grep -E "^ *[0-9]" $OUT/$f.log | head -4; done
fi
pack
