"""The kernels with an fp8 cache compile for sm_90 (Hopper) without a GPU, and their scale
loads are pipelined with the K/V tiles: a GPU-only compile error or a synchronous load in the
main loop would otherwise show first on the GPU machine (tests/sm90_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")
SCRIPT = Path(__file__).with_name("sm90_compile.py")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default Triton 3.9 warns it will change
    run = subprocess.run([sys.executable, str(SCRIPT), "decode", "prefill", "rope"],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {r["variant"]: r for r in rows}


def test_every_variant_compiles_for_sm90(compiled):
    # (not imported here: the script drops TRITON_INTERPRET, which this process needs)
    fp8 = {"decode-bf16", "decode-fp8", "decode-fp8-d256-window-softcap", "decode-fp8-fp32",
           "prefill-fp8", "prefill-fp8-d256-window-softcap", "rope-fp8"}  # fmt: skip
    assert fp8 <= set(compiled), set(compiled)
    assert all(row["shared"] > 0 or name.startswith("rope") for name, row in compiled.items())


def test_fp8_scale_loads_are_copied_ahead_with_the_tiles(compiled):
    """In the decode and prefill loops only the block-table entries load synchronously (as
    over a bf16 cache); the bf16 scales go through cp.async with the K/V tiles."""
    for name, row in compiled.items():
        if name.startswith(("decode", "prefill")):
            assert row["cp_async"] + row["tma_loads"] > 0, row
            assert all("i32" in t for t in row["loop_loads"]), row


def test_fp8_tiles_take_half_the_shared_memory_of_bf16(compiled):
    """The pipeline's K/V buffers hold fp8 bytes: at (64, 4, 4), 3 stages of 64 x 128 K and V
    tiles are 48 KB against bf16's 96 KB (plus scales and scratch)."""
    bf16, fp8 = compiled["decode-bf16"]["shared"], compiled["decode-fp8"]["shared"]
    assert fp8 < 0.6 * bf16, (fp8, bf16)
