# What a streaming HTTP client sees at long context, on one GPU: a server on dummy:llama3.1-8b
# at --max-model-len 131072, bf16 and then fp8 weights + fp8 cache; on each, three 31,000-token
# prompts (256 out), two 126,000-token prompts (256 out), and one 120,000-token document asked
# four questions one after the other (the first prefills it, the next three find it in the
# prefix cache: a repeated long prompt's first token); then in-process decode at the same
# contexts for the share the HTTP path keeps. Results in $OUT/<dtype>-{32k,128k,reuse}.json.
#   run: TREE=<commit> bash docs/benchmarks/device/http_long.sh   carry: [".whl"]
LIMIT=${LIMIT:-580}
source docs/benchmarks/device/setup.sh
M=dummy:llama3.1-8b
serve_and_load() {  # $1 tag, rest: server options
  local tag=$1; shift
  python3 -m server serve --model $M --max-model-len 131072 --port 8011 "$@" \
    > "$OUT/server-$tag.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    curl -sf localhost:8011/health > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "server $tag exited"; tail -5 "$OUT/server-$tag.log"; return 1; }
    sleep 1
  done
  curl -s localhost:8011/info > "$OUT/info-$tag.json"
  local B="python3 -m flashserve bench serve --url http://127.0.0.1:8011 --no-progress"
  step "$tag-32k" 120 $B --depth 31000 --output-len 256 --num-requests 3 --json "$OUT/$tag-32k.json"
  step "$tag-128k" 150 $B --depth 126000 --output-len 256 --num-requests 2 --json "$OUT/$tag-128k.json"
  step "$tag-reuse" 120 $B --workload shared-prefix --documents 1 --document-len 120000 \
    --questions 4 --question-len 64 --output-len 64 --concurrency 1 --json "$OUT/$tag-reuse.json"
  kill -INT $pid; wait $pid
  grep -c Traceback "$OUT/server-$tag.log" | sed "s/^/$tag tracebacks: /"
}
serve_and_load bf16
serve_and_load fp8 --kv-cache-dtype fp8 --quantization fp8
step inproc 150 python3 -m flashserve bench decode --model $M --batch 1 --steps 32 --no-peer \
  --no-progress --max-num-seqs 1 --context 31000,126000 --json "$OUT/inproc.json"
python3 - <<'PY'
import json, os, glob
O = os.environ["OUT"]
for f in sorted(glob.glob(f"{O}/*-*k.json")) + sorted(glob.glob(f"{O}/*-reuse.json")):
    try:
        d = json.load(open(f))
    except Exception as e:
        print(os.path.basename(f), "no result", e); continue
    s, lat = d["summary"], d["latency_ms"]
    line = f"{os.path.basename(f)}: ok {s['completed']}/{s['requests']} ttft p50 {lat['ttft']['p50']:.0f} ms"
    line += f", decode tok/s p50 {d['decode_tokens_per_s']['p50']:.1f}, itl p50 {lat['itl']['p50']:.2f} ms"
    reqs = d["requests"]
    if reqs and "cold" in reqs[0].get("tags", {}):
        line += " | ttft by request: " + ", ".join(
            f"{'cold' if r['tags']['cold'] else 'reused'} {r['ttft_ms']:.0f}" for r in reqs)
    print(line)
PY
ms_steps inproc
pack
