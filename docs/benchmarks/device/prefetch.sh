# Issue 14: the decode kernel's L2 prefetch before its PDL wait (DecodeTuning.prefetch_for),
# one call on two GPUs. GPU 0: bench decode of this tree (its default prefetch), of the same
# tree at PREFETCH_ALT tokens for every cache kind (a copy with those defaults), and of an
# older tree carried as .carry/old (before the prefetch), alternated per model. GPU 1
# meanwhile: the kernel tests of verify.sh's first phase (the decode kernel's among them).
# CTX: the contexts (default 4096,32768); MODELS: some of "gemma qwen llama"; TESTS=0: no
# tests on GPU 1 (then one GPU is enough). E.g. the long-context check of the prefetch and of
# the RoPE kernel's early trigger apart: TESTS=0 CTX=131072 PREFETCH_ALT=0 MODELS="llama qwen".
#   run: bash docs/benchmarks/device/prefetch.sh   kind nvidia-h100-x2, carry [".whl", ".carry/old"]
LIMIT=${LIMIT:-575}
source docs/benchmarks/device/setup.sh
OLD=${OLD:-.carry/old}
ALT=/tmp/alt
mkdir -p $ALT && cp -r kernels flashserve server $ALT/
sed -i "s/prefetch_tokens: int = [0-9]*/prefetch_tokens: int = ${PREFETCH_ALT:-64}/" \
  $ALT/kernels/decode.py
grep -n "prefetch_tokens: int" kernels/decode.py $ALT/kernels/decode.py
P="python3 -m pytest -q -o faulthandler_timeout=240"
[ "${TESTS:-1}" = 0 ] || ( export CUDA_VISIBLE_DEVICES=1
  step kernels 330 $P tests/test_kernels_gpu.py tests/test_layer_kernels.py
  step gemv 150 $P -m gpu tests/test_gemv.py tests/test_fp8_kernels.py
  step kv_fp8 90 $P tests/test_kv_fp8_gpu.py -k "not engine and not prefix"
) > "$OUT/tests.txt" 2>&1 &
export CUDA_VISIBLE_DEVICES=0
B="python3 -m flashserve bench decode --batch 1 --steps 32 --no-peer --no-progress --max-num-seqs 1"
CTX=${CTX:-4096,32768}
G="--model dummy:gemma3-12b --gpu-memory-utilization 0.93 --context $CTX"
Q="--model dummy:qwen3-8b --context $CTX"
L="--model dummy:llama3.1-8b --context $CTX"
run3() {  # name cap args: new, old, alt
  local name=$1 cap=$2; shift 2
  step ${name}_new $cap $B "$@" --json "$OUT/$name-new.json"
  (cd "$OLD" && step ${name}_old $cap $B "$@" --json "$OUT/$name-old.json")
  (cd $ALT && step ${name}_alt $cap $B "$@" --json "$OUT/$name-alt.json")
}
for m in ${MODELS:-gemma qwen llama}; do
  case $m in gemma) run3 gemma 75 $G ;; qwen) run3 qwen 55 $Q ;; llama) run3 llama 55 $L ;; esac
done
wait
cat "$OUT/tests.txt"
grep -h -E "^(FAILED|ERROR)" "$OUT"/*.log | head -20
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
print("model   ctx     new ms  old ms  alt ms  new%   old%   alt%")
for m in ("gemma", "qwen", "llama"):
    runs = {}
    for v in ("new", "old", "alt"):
        f = out / f"{m}-{v}.json"
        if f.exists():
            runs[v] = {p["context"]: p for p in json.loads(f.read_text())["points"]}
    for ctx in sorted(set().union(*[r.keys() for r in runs.values()]) if runs else []):
        got = [runs.get(v, {}).get(ctx, {}) for v in ("new", "old", "alt")]
        ms = [g.get("ours", {}).get("ms_per_step", float("nan")) for g in got]
        pc = [g.get("ours", {}).get("roofline_percent", float("nan")) for g in got]
        print(f"{m:7} {ctx:6} " + " ".join(f"{x:7.3f}" for x in ms) + " "
              + " ".join(f"{x:6.1f}" for x in pc))
PY
pack
