"""The Gluon prefill kernel (``path="gluon"``) compiles for sm_90 without a GPU, as the
warp-specialized kernel it is meant to be: three partitions (two consumer warpgroups, one
producer warp), registers moved between them by ``setmaxnreg``, no spills at head dims 64 and
128, bulk tensor copies, and a ``wgmma`` left in flight under the softmax (a wait with one
group outstanding). Counts from tests/sm90_compile.py.

The kernel is written for Triton 3.6 (the GPU machine's): Gluon's API moved by 3.9 (no
``gl.thread_barrier``), so under another Triton this module skips. Run it with 3.6 first on
the path: ``PYTHONPATH=/tmp/t36:$PWD python -m pytest -q tests/test_gluon_compile.py``.
"""

from __future__ import annotations

import pytest
from compile_reports import sm90_reports

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")
H100_SMEM = 232_448  # bytes of shared memory a block may have on sm_90


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    if not triton.__version__.startswith("3.6."):
        pytest.skip(f"the Gluon kernel targets Triton 3.6, this is {triton.__version__}")
    return sm90_reports("gluon")


def test_every_gluon_variant_compiles_and_fits(compiled):
    assert len(compiled) == 8 and all(k.startswith("gluon-prefill-") for k in compiled), compiled
    for name, row in compiled.items():
        assert 0 < row["shared"] <= H100_SMEM, (name, row)
        assert row["tma_loads"] > 0 and row["wgmma"] > 0, (name, row)


def test_the_launchers_call_compiles_to_the_same_kernel(compiled):
    """``launch_args`` through Triton's binder (real tensors, descriptors, strides, options)
    gives the kernel the variants describe: the launcher and the kernel agree."""
    launched = {**compiled["gluon-prefill-launch-d128-page128"], "variant": None}
    assert launched == {**compiled["gluon-prefill-d128-page128"], "variant": None}, launched


def test_gluon_kernel_is_warp_specialized(compiled):
    """Default partition (consumer 0) 4 warps, consumer 1 4 warps, producer 1 warp; the
    consumers at 240 registers and the producer at 24 (12 warps at launch: 168 each)."""
    for name, row in compiled.items():
        assert row["partition_warps"] == [4, 4, 1], (name, row)
        assert row["requested_regs"] == [240, 24], (name, row)
        assert {24, 240} <= set(row["setmaxnreg"]) and row["regs"] == 168, (name, row)


def test_gluon_softmax_overlaps_p_v_without_spills(compiled):
    """Per consumer: S_j's wait leaves P_{j-1} V_{j-1} in flight (depth 1), once per
    consumer; no local memory at d64/d128 (d256: O alone is 128 registers a thread)."""
    for name, row in compiled.items():
        assert row["wgmma_waits"].get("1") == 2, (name, row)
        if "d256" not in name:
            assert row["stl"] == row["ldl"] == row["stack_bytes"] == 0, (name, row)
