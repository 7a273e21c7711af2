"""The kernels with an fp8 cache compile for sm_90 (Hopper) without a GPU, their scale loads
are pipelined with the K/V tiles, and decode's loop converts e4m3 to f16 only, with packed
conversions and no byte-wise shared-memory loads: a GPU-only compile error, a synchronous load
in the main loop or a lost conversion path would otherwise show first on the GPU machine
(tests/sm90_compile.py)."""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return sm90_reports("decode", "prefill", "rope")


def test_every_variant_compiles_for_sm90(compiled):
    # (not imported here: the script drops TRITON_INTERPRET, which this process needs)
    fp8 = {"decode-bf16", "decode-fp8", "decode-fp8-fp16", "decode-fp8-d256-window-softcap",
           "decode-fp8-fp32", "prefill-fp8", "prefill-fp8-d256-window-softcap",
           "rope-fp8"}  # fmt: skip
    assert fp8 <= set(compiled), set(compiled)
    assert all(row["shared"] > 0 or name.startswith("rope") for name, row in compiled.items())


def test_fp8_scale_loads_are_copied_ahead_with_the_tiles(compiled):
    """In the decode and prefill loops only the block-table entries load synchronously (as
    over a bf16 cache); the bf16 scales go through cp.async with the K/V tiles, or, where a
    tile has one scale a thread (``scales_ahead``: the default fp8 decode tiles at head dim
    128, (128, 4, 3)), the kernel loads them a tile ahead itself: the K and the V scales, two
    bf16 loads in the loop."""
    from kernels.decode import decode_config, scales_ahead

    ahead = scales_ahead(True, *decode_config(128, fp8=True)[:2])
    for name, row in compiled.items():
        if name.startswith(("decode", "prefill")):
            assert row["cp_async"] + row["tma_loads"] > 0, row
            scales = [t for t in row["loop_loads"] if "i32" not in t]
            if ahead and name in ("decode-fp8", "decode-fp8-fp16"):
                assert len(scales) == 2 and all("bf16" in t for t in scales), row
            else:
                assert not scales, row


F16_DECODE = ("decode-fp8", "decode-fp8-fp16", "decode-fp8-d256-window-softcap")


def test_fp8_decode_runs_f16_dots_on_packed_conversions(compiled):
    """bf16 and fp16 queries alike: e4m3 pairs to f16 in one ``cvt.rn.f16x2.e4m3x2``, never a
    scalar ``cvt.bf16.f16`` (128 per tile and thread before), f16 MMAs only, and V reaches its
    dot through ldmatrix.trans of an f16 tile, not as e4m3 bytes gathered one by one
    (``ld.shared.b8``)."""
    for name in F16_DECODE:
        ops = compiled[name]["loop"]["ops"]
        assert ops.get("cvt.rn.f16x2.e4m3x2", 0) > 0, (name, ops)
        assert not any("bf16.f16" in op or "ld.shared.b8" in op for op in ops), (name, ops)
        mma = [op for op in ops if op.startswith("mma")]
        assert mma and all(op.endswith(".f32.f16.f16.f32") for op in mma), (name, ops)
        assert ops.get("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", 0) > 0, (name, ops)


def test_decode_loops_do_not_spill(compiled):
    for name in ("decode-bf16", *F16_DECODE):
        assert compiled[name]["stack_bytes"] == 0, (name, compiled[name])


def test_decode_smem_model_matches_the_compiled_kernels(compiled):
    """``programs_per_sm`` counts a program's shared memory as its K/V tiles (``_tile_bytes``:
    with an fp8 cache, plus the f16 V tile) and 9 KB (scratch and the driver's 1 KB): within 4
    KB of what Triton asks, at the bf16 and the fp8 tiles."""
    from kernels.decode import _tile_bytes, decode_config

    for name, fp8, d in (("decode-bf16", False, 128), ("decode-fp8", True, 128),
                         ("decode-fp8-d256-window-softcap", True, 256)):  # fmt: skip
        block_n, _, stages = decode_config(d, fp8=fp8)
        model = _tile_bytes(block_n, stages, d, 1 if fp8 else 2, fp8) + (9 << 10)
        assert abs(model - (compiled[name]["shared"] + 1024)) <= 4096, (name, model)


HOPPER_FP8 = [f"prefill-hopper-fp8-d{d}-page{p}" for d in (64, 128, 256) for p in (64, 128)]
HOPPER_FP8 += [f"prefill-hopper-fp8-d{d}-page{p}-heads" for d in (64, 128) for p in (64, 128)]


def test_fp8_hopper_prefill_copies_the_tiles_by_tma_and_the_scales_beside(compiled):
    """The Hopper path over an fp8 cache (``hopper_config``'s tiles, and a window with a
    soft-cap): e4m3 tiles and their scales by bulk tensor copies (no per-thread cp.async
    left), nothing synchronous in the KV loops (the block-table entry comes a tile ahead),
    warpgroup MMAs, within the H100's 227 KiB of shared memory a block."""
    for name in [*HOPPER_FP8, "prefill-hopper-fp8-d256-page64-window-softcap"]:
        row = compiled[name]
        assert row["tma_loads"] > 0 and row["cp_async"] == 0 and row["wgmma"] > 0, (name, row)
        assert row["loop_loads"] == [], (name, row)
        assert row["shared"] <= 227 << 10, (name, row)


def test_fp8_hopper_prefill_64_key_tiles_do_not_spill(compiled):
    """64-key tiles up to head dim 128 keep to the register file (Triton 3.6 and 3.9); at
    d128 with 128 keys and at d256 every config fills it (hopper_config)."""
    for name in (
        "prefill-hopper-fp8-d64-page64",
        "prefill-hopper-fp8-d64-page128",
        "prefill-hopper-fp8-d128-page64",
        "prefill-hopper-fp8-d64-page64-heads",
        "prefill-hopper-fp8-d64-page128-heads",
        "prefill-hopper-fp8-d128-page64-heads",
    ):
        assert compiled[name]["stack_bytes"] == 0, (name, compiled[name])
