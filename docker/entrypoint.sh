#!/bin/sh
# The image's entry point: the server on every interface, port 8000. Arguments go on to
# `flashserve serve`, e.g. --model /models/my-model.gguf.
set -e
exec flashserve serve --host 0.0.0.0 --port 8000 "$@"
