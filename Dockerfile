# flashserve on an NVIDIA GPU.
#   docker build -t flashserve .
#   docker run --gpus all -p 8000:8000 flashserve                      # the default model
#   docker run --gpus all -p 8000:8000 -v "$PWD/models:/models" flashserve --model /models/NAME
#   docker run --gpus all -p 8000:8000 -v flashserve-cache:/cache flashserve  # keep compiled kernels
# Arguments after the image name go to `flashserve serve` (host and port are set here).
FROM python:3.11-slim-bookworm

# gcc and the C headers: Triton compiles a small C launcher when a kernel first runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# Triton's compiled kernels go under /cache: a volume there keeps them between containers, so a
# restarted server skips the compiles (its start-up warm-up: 15.9 s on a fresh pair of H200s at
# TP=2, 0.3-0.6 s with the cache warm; docs/benchmarks/serving.md)
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRITON_CACHE_DIR=/cache/triton

WORKDIR /opt/flashserve

# torch (CUDA build, several GB) in a layer of its own, kept while the code changes
COPY docker/install.sh docker/install.sh
RUN sh docker/install.sh --torch-only

COPY . .
RUN sh docker/install.sh \
    && useradd --create-home --uid 1000 flashserve \
    && mkdir -p /cache/triton \
    && chown -R flashserve:flashserve /cache

USER 1000:1000
EXPOSE 8000
# start period: loading the model and compiling the kernels the first time
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["sh", "/opt/flashserve/docker/entrypoint.sh"]
