"""The prefill kernel's paths and what the Hopper path needs, apart from ``kernels.prefill`` so
that the engine's config and command line read them without importing Triton."""

# the engine's choices (EngineConfig.prefill_path); auto: a few query tiles over a long context
# on the portable kernel over parts of the keys (prefill_kv_splits), else gluon where it can
# run, else hopper where it can, else portable (kernels.prefill)
PATHS = ("auto", "portable", "hopper", "gluon")
# "auto" takes the sm_90 paths from here: KV tiles of >= 64 keys. The Gluon kernel's tiles
# (128 keys, 64 at d256, cut to the page) would run on shorter pages, but its GPU tests cover
# pages of 64 and 128 only, so the engine holds both sm_90 paths to this.
HOPPER_MIN_PAGE = 64
HOPPER_HEAD_DIMS = (64, 128, 256)  # a descriptor block is [BLOCK_N, D]: a power of two
GLUON_TRITON = "3.6."  # the Gluon API it is written in (experimental: it changed by 3.9)


def gluon_triton_refusal(version: str) -> str | None:
    """Why the Gluon kernel cannot run under Triton ``version`` (None: it can)."""
    if version.startswith(GLUON_TRITON):
        return None
    return (f"the Gluon kernel is written for Triton {GLUON_TRITON}x's Gluon API (experimental: "
            f"it changed by 3.9); this Triton is {version}")  # fmt: skip
