"""The GEMV compiles for sm_90 (Hopper) without a GPU, and its fp8 main loop is the cheap one:
e4m3 widened in pairs to f16 for the tensor cores, no fp32 widening and FMAs per element (the
loop that reached 64-70% of the H100's bandwidth had 3.5 SASS instructions per byte of weight,
twice bf16's; docs/benchmarks/fp8.md). Counts from tests/sm90_compile.py."""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return sm90_reports("gemv")


def test_every_gemv_variant_compiles_without_spills(compiled):
    """No spill: no stack frame, no local loads or stores in the K loop."""
    assert len(compiled) == 26 and all(k.startswith("gemv-") for k in compiled), list(compiled)
    for name, row in compiled.items():
        spilled = row["stack_bytes"] + row["local_bytes"]
        assert spilled == 0 and row["loop"]["sass_local"] == 0, (name, row)
        assert row["regs"] <= 255 and row["loop"]["sass"] > 0, (name, row)


def test_gated_epilogue_leaves_the_streaming_loop_alone(compiled):
    """The gated GEMV (activation in the epilogue) at each twin's tile: the K loop's SASS
    instructions per weight byte within 2% of the ungated kernel's (block scales 4%: a second
    scale a part, for the up rows, and its select; 1.5-3.3% seen), same kinds of MMA."""
    twins = [name for name in compiled if name.startswith("gemv-gated-")]
    assert len(twins) == 7, twins
    for gated in twins:
        plain = compiled[gated.replace("-gated", "")]["loop"]
        loop = compiled[gated]["loop"]
        slack = 1.04 if "block" in gated else 1.02
        assert loop["per_byte"]["sass"] <= slack * plain["per_byte"]["sass"], (gated, loop, plain)
        assert (loop["mma"], loop["wgmma"]) == (plain["mma"], plain["wgmma"]), gated


def test_fp8_loops_use_tensor_cores_and_no_fp32_fmas(compiled):
    """Every fp8 loop multiplies on the tensor cores; per-channel loops have no fp32 FMA, block
    loops only the accumulator's (one scale a K step, <= 1/8 per byte; 1/2 with diag), where
    the loop they replace had one per weight byte."""
    for name, row in compiled.items():
        if not name.startswith("gemv-fp8"):
            continue
        loop = row["loop"]
        assert loop["mma"] + loop["wgmma"] > 0, (name, loop)
        # (diag: the accumulator [8 BN, 8] is 4x [BN, 16]: 4x the scales' FMAs)
        block_fma = 0.5 if name.endswith("-diag") else 0.125
        assert loop["per_byte"]["fma"] <= (block_fma if "block" in name else 0.0), (name, loop)
        # the replaced loop: 1.66; one-warp tiles convert x's step for 16-32 rows, not 64
        one_warp = name.endswith(("-m1", "-m1-split", "-m1-fp16"))
        assert loop["per_byte"]["cvt"] <= (1.6 if one_warp else 1.2), (name, loop)


def test_fp8_batch_one_costs_no_more_instructions_per_byte_than_bf16(compiled):
    """M = 1, SASS instructions per byte of weight: the 64-rows-a-warp tile (mma.sync) at most
    bf16's; the one-warp tiles of 16 and 32 rows (x's fragments shared by fewer rows) under
    1.5x of it; all under the replaced loop's 3.5. (Their speed is the grid's, not this:
    docs/benchmarks/fp8.md, the 2026-11-27 sweep.)"""
    bf16 = compiled["gemv-bf16-m1"]["loop"]["per_byte"]["sass"]
    mma2 = compiled["gemv-fp8-channel-m1-mma2"]["loop"]["per_byte"]["sass"]
    narrow = compiled["gemv-fp8-channel-m1"]["loop"]["per_byte"]["sass"]
    split = compiled["gemv-fp8-channel-m1-split"]["loop"]["per_byte"]["sass"]
    assert mma2 <= bf16 and max(narrow, split) <= 1.5 * bf16, (bf16, mma2, narrow, split)
    assert max(mma2, narrow, split) < 3.0, (mma2, narrow, split)


def test_fp8_diag_halves_the_instructions_of_one_warp_tiles(compiled):
    """M = 1 with x's row as 8 chunks side by side (``diag``): the dot 8 columns wide instead
    of x repeated to 16, x converted once a chunk: half the MMAs and at most 0.65x the SASS
    per weight byte of the same tile (seen: 0.49 unsplit, 0.58 split, Triton 3.9); block
    scales 0.75x (0.68: their FMAs on an accumulator 4x as wide)."""
    for name in ("gemv-fp8-channel-m1", "gemv-fp8-channel-m1-split", "gemv-fp8-block-m1"):
        plain, diag = compiled[name]["loop"], compiled[name + "-diag"]["loop"]
        assert 2 * diag["mma"] == plain["mma"] and diag["wgmma"] == 0, (name, diag, plain)
        most = 0.75 if "block" in name else 0.65
        assert diag["per_byte"]["sass"] <= most * plain["per_byte"]["sass"], (name, diag, plain)


def test_fp8_diag_at_eight_rows_costs_what_one_row_does(compiled):
    """diag at M = 8 (8 rows of one chunk each: the dot 8 columns, no repeats): the one-warp
    tile's SASS per weight byte as at M = 1, and at most 0.55x the 4-warp wgmma tile M > 1
    takes today (seen: 1.41 against 3.01)."""
    m8 = compiled["gemv-fp8-channel-m8-narrow-diag"]["loop"]["per_byte"]["sass"]
    m1 = compiled["gemv-fp8-channel-m1-diag"]["loop"]["per_byte"]["sass"]
    wgmma = compiled["gemv-fp8-channel-m8"]["loop"]["per_byte"]["sass"]
    assert m8 <= 1.02 * m1 and m8 <= 0.55 * wgmma, (m8, m1, wgmma)


def test_bf16_diag_takes_a_fraction_of_the_instructions(compiled):
    """bf16 weights with diag (one warp, 16 rows): at M = 1 at most 0.3x the elementwise loop's
    SASS per weight byte (seen: 0.42 against 1.97), at M = 8 at most 0.6x the wgmma tile's
    (0.42 against 0.90)."""
    loop = {name: compiled[name]["loop"]["per_byte"]["sass"] for name in compiled}
    assert loop["gemv-bf16-m1-diag"] <= 0.3 * loop["gemv-bf16-m1"], loop
    assert loop["gemv-bf16-m8-diag"] <= 0.6 * loop["gemv-bf16-m8"], loop


@pytest.fixture(scope="module")
def rownorm() -> dict[str, dict]:
    return sm90_reports("rownorm", "gemv-bf16", "gemv-gated-bf16-m1", "gemv-fp8-channel-m1-diag")


def test_the_norm_fold_leaves_the_streaming_loop_alone(rownorm):
    """The norm between two projections folded into their GEMVs, at each twin's tile: no
    spill; the producer's part (the residual add, the tile sums) touches the epilogue only
    (the K loop's SASS per weight byte within 1%; over fp8 weights as the launcher compiles
    it, with ptxas's register cap: without it 96 registers and 3-5% more, NOPs between the
    HMMAs, the GEMV 41% slower on the H100); the consumer's multiplies x
    by the norm's weight as it loads (within 25%: 7.5% at M = 1, 20% on the M = 8 diag tile,
    where x is a larger share of the loop; the rows' 1 / rms applies after the loop), the same
    MMAs. Its exact rounding in the loop had cost fp8's diag tile 2.4x (docs/benchmarks/fp8.md,
    session 25)."""
    folded = [name for name in rownorm if name.startswith("rownorm-")]
    assert len(folded) == 8, folded
    for name in folded:
        row = rownorm[name]
        assert row["stack_bytes"] + row["local_bytes"] == 0 and row["regs"] <= 255, (name, row)
        twin = name.removeprefix("rownorm-").replace("residual-", "").replace("norm-", "")
        loop, plain = row["loop"], rownorm[twin]["loop"]
        slack = 1.01 if "-residual-" in name else 1.25
        assert loop["per_byte"]["sass"] <= slack * plain["per_byte"]["sass"], (name, loop, plain)
        assert (loop["mma"], loop["wgmma"]) == (plain["mma"], plain["wgmma"]), name
