"""The decode layer's PDL protocol as compiled for sm_90 (tests/sm90_compile.py): the RoPE
kernel lets its successor launch before its own wait and reads nothing before it but the
step's inputs (a position, a slot, the tables' rows), and the decode kernel, launched early
behind it, reads nothing before its wait but the step's inputs (a length, block-table
entries: 32-bit scalar loads) and asks L2 for its first KV tile; over an fp8 cache too. A
wrong order would show on the GPU only as a rare wrong token."""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return sm90_reports("decode-bf16", "decode-fp8", "rope")  # prefixes: decode-bf16-few-rows


def test_rope_lets_the_decode_kernel_launch_before_its_wait(compiled):
    """The RoPE kernel lets the decode kernel launch first, then loads the step's inputs
    before its own wait (the token's position and slot: two 64-bit scalars; its rows of the
    cos/sin tables: at most two loads each), nothing the QKV GEMV before it writes."""
    for name in ("rope-fp8", "rope-bf16-head-a-program"):
        assert compiled[name]["pdl"] == ["launch_dependents", "wait"], compiled[name]["pdl"]
        loads = compiled[name]["before_wait"]["loads"]
        assert loads.count("ld.global.b64") == 2, (name, loads)
        assert 2 <= len(loads) - 2 <= 4 and all(op.startswith("ld.global.") for op in loads), (
            name,
            loads,
        )


@pytest.mark.parametrize(
    "name", ["decode-bf16", "decode-bf16-few-rows", "decode-fp8", "decode-fp8-d256-window-softcap"]
)
def test_decode_reads_only_step_inputs_before_its_wait(compiled, name):
    row = compiled[name]
    assert row["pdl"] == ["wait", "launch_dependents"], row["pdl"]
    before = row["before_wait"]
    assert before["l2_prefetch"] >= 2, before  # K and V rows
    # the sequence's length and its first tile's block-table entries: 32-bit scalars, where
    # the queries (bf16/fp16/fp32 rows) would load as vectors and K/V go through cp.async
    assert 2 <= len(before["loads"]) <= 4, before
    assert set(before["loads"]) == {"ld.global.b32"}, before
