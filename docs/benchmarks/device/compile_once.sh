# The prefill kernels compiled once for every step's counts (kernels.common.PREFILL_STEP_INTS
# unspecialized, the tables' width padded to one kind): the GPU test that no step of another kind
# compiles them again, and the prefill kernels' tests (and that test over the base tree's
# kernels, where it should fail); the prefill kernel table (4K / 16K, every path) of this tree
# and of one without it carried as .carry/base (`git archive <rev> flashserve kernels server | tar -x -C
# .carry/base`); then start-up with Triton's cache empty and warm, both trees (startup.sh).
#   run: TREE=<commit> bash docs/benchmarks/device/compile_once.sh   carry: [".whl", ".carry/base"]
LIMIT=${LIMIT:-400}
source docs/benchmarks/device/setup.sh
BASE="env -C $PWD/.carry/base PYTHONPATH=/tmp/site:$PWD/.carry/base"
K="python3 -m kernels.bench --batches '' --prefill 4096,16384"
step tests 200 python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -k "prefill"
# the same test over the base tree's kernels: it should fail there (a step of a new kind compiles)
step test_on_base 90 $BASE python3 -m pytest -q -m gpu "$PWD/tests/test_kernels_gpu.py" -k compiles_once
step kb_new 60 bash -c "$K"
step kb_base 60 $BASE bash -c "$K"
for f in kb_new kb_base; do echo "== $f"; grep -E "prefill|gluon|hopper|portable" "$OUT/$f.log" | head -12; done
OLD=.carry/base bash docs/benchmarks/device/startup.sh
