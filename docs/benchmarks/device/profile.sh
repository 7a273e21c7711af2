# Where the decode step's time goes, kernel by kernel (torch profiler over 8 graph replays per
# point, `bench decode --profile`): issue 14 (Gemma 3 at 4K / 32K against Llama at 4K), issue 15
# (Llama at 4K with fp8 weights and KV against bf16) and, with two GPUs, issue 18 (rank 0 of
# TP=2 with NCCL, the one-shot all-reduce and the folded one, against TP=1, at 32K). Each
# runs without the PDL chain too: in the chain a kernel's span includes its wait for the one
# before (kernels-notes.md, round 3), without it each span is its own. Each point leaves a
# table of ops, one of kernels by name and grid (`*-launches.txt`) and a Chrome trace.
#   run: [WHAT="archs fp8 tp"] bash docs/benchmarks/device/profile.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
B="python3 -m flashserve bench decode --batch 1 --steps 16 --no-peer --no-progress"
G="--model dummy:gemma3-12b --gpu-memory-utilization 0.93 --context 4096,32768"
WHAT=${WHAT:-archs fp8 tp}
if [[ " $WHAT " == *" archs "* ]]; then
  step gemma_nochain 100 $B $G --no-pdl-chain --profile "$OUT/gemma-nochain"
  step gemma_chain 100 $B $G --profile "$OUT/gemma-chain"
fi
if [[ " $WHAT " == *" archs "* || " $WHAT " == *" fp8 "* ]]; then
  step llama_nochain 60 $B --model dummy:llama3.1-8b --context 4096 --no-pdl-chain \
    --profile "$OUT/llama-nochain"
fi
if [[ " $WHAT " == *" fp8 "* ]]; then
  step llama_fp8_nochain 60 $B --model dummy:llama3.1-8b --context 4096 --no-pdl-chain \
    --kv-cache-dtype fp8 --quantization fp8 --profile "$OUT/llama-fp8-nochain"
fi
if [[ " $WHAT " == *" tp "* ]] && [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
  T="--model dummy:llama3.1-8b --context 32768 --no-pdl-chain"
  step tp1_prof 60 $B $T --profile "$OUT/tp1"
  step tp2_nccl_prof 70 $B $T --tensor-parallel-size 2 --profile "$OUT/tp2-nccl"
  step tp2_auto_prof 70 $B $T --tensor-parallel-size 2 --tp-all-reduce auto --profile "$OUT/tp2-auto"
  step tp2_fused_prof 70 $B $T --tensor-parallel-size 2 --tp-all-reduce fused \
    --profile "$OUT/tp2-fused"
fi
for f in "$OUT"/*/*.txt; do echo "== $f"; head -22 "$f" | cut -c1-160; done
# the Chrome traces come back only while the packed results stay under a returned file's 16 MiB
find "$OUT" -mindepth 2 -name '*.json' -exec gzip -9 {} +
[ "$(du -sb "$OUT" | cut -f1)" -gt 14000000 ] && find "$OUT" -mindepth 2 -name '*.json.gz' -delete
pack
