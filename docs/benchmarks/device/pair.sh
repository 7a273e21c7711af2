# Two scripts of this folder at once on a two-GPU machine, one a GPU, each with its own output
# folder ($OUT/first, $OUT/second: each packs its own all.tgz), e.g. the fp8 GEMV sweep beside
# the time-to-first-token budgets:
#   FIRST="PHASE=gemv MS=1 fp8.sh" SECOND="ttft_chunks.sh" bash docs/benchmarks/device/pair.sh
#   carry: [".whl"]
# FIRST and SECOND: a script's name, after the environment variables it takes.
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh  # the wheels once, before both start
run_one() {  # GPU, folder, "VAR=value ... script.sh"
  local gpu=$1 dir=$2; shift 2
  mkdir -p "$OUT/$dir"
  env CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/$dir" LIMIT=$(( LIMIT - 5 )) $(echo "$1" | tr ' ' '\n' \
    | grep = | tr '\n' ' ') bash "docs/benchmarks/device/$(echo "$1" | tr ' ' '\n' | grep -v =)" \
    > "$OUT/$dir.txt" 2>&1
}
run_one 0 first "$FIRST" &
run_one 1 second "$SECOND" &
wait
echo "== first: $FIRST"; cat "$OUT/first.txt"
echo "== second: $SECOND"; cat "$OUT/second.txt"
