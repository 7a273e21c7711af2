# Server start-up as a fresh container sees it: seconds from `python3 -m server serve` to the
# first 200 from /health, with an empty Triton cache (every kernel variant the CUDA-graph
# capture needs compiled then), for this tree and an older one (OLD, default .carry/old),
# alternated; then once more with the cache the first start left (the warm start).
# $MODEL (dummy:llama3.1-8b) and this script's arguments are the server's options; OLD=none
# times this tree alone (a cold start, then a warm one).
#   run: TREE=<commit> bash docs/benchmarks/device/startup.sh   carry: [".whl", ".carry/old"]
source docs/benchmarks/device/setup.sh
OLD=${OLD:-.carry/old}
MODEL=${MODEL:-dummy:llama3.1-8b}
start() {  # name dir cache [server options]: the time to healthy, or the log's tail if it died
  local name=$1 dir=$2 cache=$3 port=8020 t0 pid
  t0=$(date +%s%N)
  (cd "$dir" && TRITON_CACHE_DIR=$cache exec python3 -m server serve --model "$MODEL" \
    --port $port "${@:4}") > "$OUT/$name.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 1500); do  # 5 minutes at most
    curl -sf "localhost:$port/health" > /dev/null && break
    kill -0 $pid 2> /dev/null || { echo "$name: the server exited"; tail -3 "$OUT/$name.log"; return; }
    sleep 0.2
  done
  echo "$name: $(( ($(date +%s%N) - t0) / 1000000 )) ms to healthy"
  kill -INT $pid; wait $pid
}
start new_cold . /tmp/tc-new "$@"
[ "$OLD" = none ] || start old_cold "$OLD" /tmp/tc-old "$@"
start new_warm . /tmp/tc-new "$@"
[ "$OLD" = none ] || start old_warm "$OLD" /tmp/tc-old "$@"
pack
