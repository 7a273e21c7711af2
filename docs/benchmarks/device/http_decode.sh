# Decode tokens/s as a streaming HTTP client sees it: a server on $MODEL (dummy:llama3.1-8b;
# its own options: this script's arguments), then three requests of $DEPTH (31,000) prompt
# tokens and 256 out, one at a time (`bench serve --depth`; the client times the tokens it receives). Used by the
# other scripts as a step: `step NAME CAP bash docs/benchmarks/device/http_decode.sh [ARGS]`.
# SHORT=1 first sends two short /generate requests (8 tokens out) and prints their seconds: a
# fresh server's first request, as a chat user meets it, and the next. LOAD replaces the three
# requests with other `bench serve` options, run ROUNDS times (1), each round's results in
# $OUT/http-<port>-<pid>-r<round>.json. At the end it counts the kernels Triton compiled after
# the server reported ready (new folders in its cache, $TRITON_CACHE_DIR or ~/.triton/cache,
# by their .cubin files' names): what the start-up warm-up missed, if the cache started empty.
PORT=${PORT:-8011} MODEL=${MODEL:-dummy:llama3.1-8b} DEPTH=${DEPTH:-31000}
python3 -m server serve --model "$MODEL" --max-model-len $((DEPTH + 9000)) --port "$PORT" "$@" \
  > "$OUT/server-$PORT-$$.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do
  curl -sf "localhost:$PORT/health" > /dev/null && break
  kill -0 $pid 2> /dev/null || { echo "the server exited"; tail -5 "$OUT/server-$PORT-$$.log"; exit 1; }
  sleep 1
done
cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
ls "$cache" 2> /dev/null | sort > "$OUT/cache-$PORT-$$.txt"
for _ in $([ "${SHORT:-0}" = 1 ] && echo 1 2); do
  curl -s -o /dev/null -w "short request: %{http_code} in %{time_total} s\n" \
    -H 'Content-Type: application/json' "localhost:$PORT/generate" \
    -d '{"inputs": "Hello there", "parameters": {"max_new_tokens": 8}}'
done
LOAD=${LOAD:-"--depth $DEPTH --output-len 256 --num-requests 3"}
rc=0
for r in $(seq 1 "${ROUNDS:-1}"); do
  # shellcheck disable=SC2086 # LOAD is a list of options
  python3 -m flashserve bench serve --url "http://127.0.0.1:$PORT" $LOAD --seed "$r" --no-progress \
    --json "$OUT/http-$PORT-$$-r$r.json" || rc=$?
done
kill -INT $pid; wait $pid
echo "Triton compiles after the server was ready (count, kernel):"
ls "$cache" 2> /dev/null | sort | comm -13 "$OUT/cache-$PORT-$$.txt" - | while read -r d; do
  for f in "$cache/$d"/*.cubin; do [ -e "$f" ] && basename "$f" .cubin; done
done | sort | uniq -c
grep -c Traceback "$OUT/server-$PORT-$$.log" | sed 's/^/tracebacks in the server log: /'
exit $rc
