# Issue 15 (and 18): each decode GEMV asking L2 for the next projection's first bytes as it
# ends (EngineConfig.weight_prefetch_bytes, --weight-prefetch-mb). One GPU: its GPU tests
# (TESTS=0: none), then bench decode of dummy:llama3.1-8b at batch 1 for each of MIBS (MiB;
# default "0 16 32"), alternated ROUNDS times (default 2), with ARGS (default: fp8 weights +
# fp8 KV) at CTX (default 4096,32768,131072).
#   run: TREE=<commit> bash docs/benchmarks/device/weight_prefetch.sh   carry [".whl"]
LIMIT=${LIMIT:-585}
source docs/benchmarks/device/setup.sh
P="python3 -m pytest -q -o faulthandler_timeout=200"
[ "${TESTS:-1}" = 0 ] || step tests 150 $P -m gpu tests/test_gemv.py -k prefetch
ARGS=${ARGS:---kv-cache-dtype fp8 --quantization fp8}
B="python3 -m flashserve bench decode --model dummy:llama3.1-8b --batch 1 --steps 32 --no-peer
  --no-progress --max-num-seqs 1 --context ${CTX:-4096,32768,131072}"
for r in $(seq ${ROUNDS:-2}); do
  for mib in ${MIBS:-0 16 32}; do
    step "mib${mib}_r$r" ${CAP:-85} $B $ARGS --weight-prefetch-mb $mib \
      --json "$OUT/mib$mib-r$r.json"
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("mib*-r*.json")):
    mib, r = re.match(r"mib(\d+)-r(\d+)", f.stem).groups()
    for p in json.loads(f.read_text())["points"]:
        rows.setdefault((p["context"], int(mib)), []).append(
            (p["ours"]["ms_per_step"], p["ours"].get("roofline_percent", float("nan"))))
print("context  MiB  ms a step (each round)   % of roofline")
for (ctx, mib), got in sorted(rows.items()):
    print(f"{ctx:7} {mib:4}  " + " ".join(f"{ms:7.3f}" for ms, _ in got) + "   "
          + " ".join(f"{pc:5.1f}" for _, pc in got))
PY
pack
