# A prompt whose long prefix the prefix cache holds: where its first token's time goes, on one
# GPU. PHASE=process: the prefill kernel per path for a short chunk over a long context
# (kernels.bench.time_prefill_chunk; the portable kernel over 2-8 parts of the keys and "auto"
# beside Gluon, two rounds; an fp8 cache at 128-token pages), then docs/benchmarks/reuse_ttft.py
# in process (bf16 with a profile, then fp8 weights + cache). PHASE=server: a server's own time
# to first token (/metrics) against the client's for a 120K document asked again, with and
# without async scheduling. Session 35 ran the two phases as two calls (as .carry/s5.sh and
# .carry/s6.sh; one `tail` fixed since); session 36 the chunk table alone (.carry/s1.sh).
#   run: TREE=<commit> PHASE=process|server bash docs/benchmarks/device/reuse_ttft.sh  carry: [".whl"]
LIMIT=${LIMIT:-560}
if [ "${PHASE:-}" = process ]; then
source docs/benchmarks/device/setup.sh
cat > /tmp/chunk.py <<'PY'
import json, os, torch
from kernels.bench import time_prefill_chunk
res = []
def one(kv, path, chunk, ctx, splits):
    kw = {"kv_splits": splits} if splits > 1 else {}
    try:
        us = time_prefill_chunk(chunk, ctx, page=128, path=path, kv=kv, **kw)
    except Exception as e:
        print(kv, path, splits, chunk, ctx, "failed", str(e)[:300], flush=True); return
    tf = 4 * 32 * 128 * chunk * (ctx - chunk / 2) / us / 1e6
    res.append({"kv": kv, "path": path, "kv_splits": splits, "chunk": chunk, "ctx": ctx, "us": us, "tflops": tf})
    print(f"{kv:4s} {path:9s} x{splits:<2d} chunk {chunk:5d} ctx {ctx:6d}: {us:9.1f} us {tf:6.1f} TFLOP/s", flush=True)
for rnd in range(2):
    for chunk in (64, 128, 512):
        for ctx in (120064, 32768):
            for path, s in (("gluon", 1), ("portable", 1), ("portable", 2), ("portable", 4), ("portable", 8), ("auto", 1)):
                one("bf16", path, chunk, ctx, s)
for chunk in (128,):
    for ctx in (120064, 32768):
        for path, s in (("auto", 1), ("hopper", 1), ("portable", 1), ("portable", 4)):
            one("fp8", path, chunk, ctx, s)
json.dump(res, open(os.environ["OUT"] + "/chunk.json", "w"), indent=1)
PY
step chunk 200 python3 /tmp/chunk.py
step reuse 200 python3 docs/benchmarks/reuse_ttft.py --model dummy:llama3.1-8b --prefix 120000 \
  --new 64 --rounds 3 --profile "$OUT/prof" --json "$OUT/reuse.json"
step reuse_fp8 170 python3 docs/benchmarks/reuse_ttft.py --model dummy:llama3.1-8b --prefix 120000 \
  --new 64 --rounds 3 --kv-cache-dtype fp8 --quantization fp8 --json "$OUT/reuse-fp8.json"
cat "$OUT/chunk.log" | grep -v "^$" | tail -30
tail -n 1 "$OUT/reuse.log"; tail -n 1 "$OUT/reuse_fp8.log"
head -25 "$OUT"/prof/reused-prefill-launches.txt 2>/dev/null | cut -c1-140
elif [ "${PHASE:-}" = server ]; then
source docs/benchmarks/device/setup.sh
met() { curl -s localhost:8011/metrics | grep -E "^flashserve_(time_to_first_token|request_queue_time|e2e_request)_seconds_(sum|count)" ; }
one() {
  local tag=$1; shift
  python3 -m server serve --model dummy:llama3.1-8b --max-model-len 131072 --port 8011 "$@" > "$OUT/server-$tag.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 200); do curl -sf localhost:8011/health > /dev/null && break; sleep 1; done
  python3 -m flashserve bench serve --url http://127.0.0.1:8011 --no-progress --workload shared-prefix \
    --documents 1 --document-len 120000 --questions 1 --question-len 64 --output-len 8 --concurrency 1 > /dev/null 2>&1
  met > "$OUT/m0-$tag.txt"
  python3 -m flashserve bench serve --url http://127.0.0.1:8011 --no-progress --workload shared-prefix \
    --documents 1 --document-len 120000 --questions 4 --question-len 64 --output-len 8 --concurrency 1 \
    --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1
  met > "$OUT/m1-$tag.txt"
  python3 - "$tag" <<'PY'
import json, os, sys
t = sys.argv[1]; O = os.environ["OUT"]
def read(f):
    return {l.split()[0]: float(l.split()[1]) for l in open(f) if l.strip()}
a, b = read(f"{O}/m0-{t}.txt"), read(f"{O}/m1-{t}.txt")
d = {k: b[k] - a.get(k, 0) for k in b}
print(t, "server means (s):", {k.replace("flashserve_", "").replace("_seconds_sum", ""): round(v / max(1, d[k.replace("_sum", "_count")]), 4) for k, v in d.items() if k.endswith("_sum")})
r = json.load(open(f"{O}/{t}.json"))["requests"]
print(t, "client ttft ms:", [(x["tags"]["cold"], round(x["ttft_ms"], 1)) for x in r])
PY
  kill -INT $pid; wait $pid
}
one default
one sync --no-async-scheduling
else
  echo "PHASE must be process or server"; exit 2
fi
pack
