# Issue 18: what the two ranks' waits cost a TP=2 step (nvidia-h200-x2), one call of under 10
# minutes. The fold's kernels wait for the other rank's words twice a layer (kernels/fold.py);
# a copy of this tree whose waits give up at once (SPIN_LIMIT 0: the sums are garbage, the
# bytes read the same) times the step without them. TP=2 fused at 32K / 128K, this tree and
# the copy alternated, TP=1 between them (the ratio's denominator, same call), then the step
# kernel by kernel for both (no PDL chain: each kernel's span its own; the norms' spans are
# their waits). The difference is the most that shorter waits (less drift between the ranks,
# less NVLink latency) could give; the rest of the gap to 1.7x is the kernels' own at half size.
#   run: TREE=<commit> bash docs/benchmarks/device/tp_sync.sh     carry: [".whl"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
NW=/tmp/nowait
rm -rf $NW && mkdir -p $NW && cp -r flashserve kernels $NW/
sed -i 's/^SPIN_LIMIT = 1 << 40$/SPIN_LIMIT = 0/' $NW/kernels/fold.py
grep -q "^SPIN_LIMIT = 0$" $NW/kernels/fold.py || { echo "SPIN_LIMIT not found"; pack; exit 1; }
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress"
B="$B --model dummy:llama3.1-8b --context ${CTX:-32768,131072}"
F="--tensor-parallel-size 2 --tp-all-reduce fused"
NOWAIT="env -C $NW PYTHONPATH=/tmp/site:$NW"
step tp2_a 85 $B $F --json "$OUT/tp2_a.json"
step tp2_nowait_a 85 $NOWAIT $B $F --json "$OUT/tp2_nowait_a.json"
step tp1 80 $B --json "$OUT/tp1.json"
step tp2_b 85 $B $F --json "$OUT/tp2_b.json"
step tp2_nowait_b 85 $NOWAIT $B $F --json "$OUT/tp2_nowait_b.json"
P="--context 32768 --steps 16 --no-pdl-chain"
step prof 70 $B $F $P --profile "$OUT/prof"
step prof_nowait 70 $NOWAIT $B $F $P --profile "$OUT/prof-nowait"
ms_steps tp2_a tp2_nowait_a tp1 tp2_b tp2_nowait_b
pack
