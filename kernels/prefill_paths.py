"""The prefill kernel's paths and what the Hopper path needs, apart from ``kernels.prefill`` so
that the engine's config and command line read them without importing Triton."""

PATHS = ("auto", "portable", "hopper")  # the engine's choices (EngineConfig.prefill_path)
# kernel-level only until its GPU tests pass: no engine start-up checks cover it yet
OPT_IN_PATHS = ("gluon",)
HOPPER_MIN_PAGE = 64  # "auto" takes the Hopper path from here: KV tiles of >= 64 keys
HOPPER_HEAD_DIMS = (64, 128, 256)  # a descriptor block is [BLOCK_N, D]: a power of two
