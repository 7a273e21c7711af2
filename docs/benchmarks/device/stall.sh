# Compiles in the middle of serving: a fresh server (Triton's cache empty: its own folder), then
# two rounds of a mixed load through HTTP (Poisson arrivals at 4 requests/s, prompts of 200 to
# 3,800 tokens, 64 out: steps of several prompts, and prefill chunks beside decodes), this tree
# and then one carried as .carry/base (`git archive <rev> flashserve kernels server | tar -x -C
# .carry/base`). A kernel compiled after start-up shows as a first round whose longest gap
# between tokens (or longest wait for a first token) is seconds where the second round's is not;
# compile_hook/ logs every compile with its specialization key (compiles-<step>.txt), and the
# table at the end names those after the server was ready.
#   run: TREE=<commit> bash docs/benchmarks/device/stall.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
H=$PWD/docs/benchmarks/device/http_decode.sh
export ROUNDS=2 LOAD="--request-rate 4 --num-requests 40 --input-len 2000 --input-len-range 0.9
--output-len 64"
HOOK=$PWD/docs/benchmarks/device/compile_hook
COMPILE_LOG=$OUT/compiles-new.txt PYTHONPATH=$HOOK:$PYTHONPATH PORT=8011 \
  TRITON_CACHE_DIR=/tmp/tc-new step new 250 bash $H
COMPILE_LOG=$OUT/compiles-base.txt PORT=8012 TRITON_CACHE_DIR=/tmp/tc-base step base 250 \
  env -C .carry/base PYTHONPATH=$HOOK:/tmp/site:$PWD/.carry/base bash $H
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(f"{os.environ['OUT']}/http-*.json"), key=os.path.getmtime):
    s = json.load(open(f))["samples_ms"]
    itl, ttft = sorted(s["itl"]), sorted(s["ttft"])
    print(os.path.basename(f), f"itl max {itl[-1]:.0f} p99 {itl[int(0.99 * len(itl))]:.1f} ms,",
          f"ttft max {ttft[-1]:.0f} p50 {ttft[len(ttft) // 2]:.0f} ms")
PY
grep -h "warm-up:\\|captured" "$OUT"/server-*.log
for t in new:8011 base:8012; do  # compiles after ready: later than the cache listing at /health
  ready=$(stat -c %Y "$OUT"/cache-"${t#*:}"-*.txt 2> /dev/null) || continue
  echo "${t%:*}: compiled after ready:"
  awk -v r="$ready" '$1 > r {print "  " $3, substr($0, index($0, $4), 400)}' "$OUT/compiles-${t%:*}.txt"
done
pack
