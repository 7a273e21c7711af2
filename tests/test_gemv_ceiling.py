"""docs/benchmarks/gemv_ceiling.py's kernels give what the benchmark checks them against before it
times them: each read kernel (pointer and TMA loads) the xor of its rows' words, the TMA-fed
GEMV the float64 product, the engine's GEMV at every tile it times. Without a GPU they run in
Triton's interpreter (conftest.py), on the script's toy shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable on this machine")

import bench_scripts  # noqa: E402
from tensor_checks import DEVICE  # noqa: E402

gc = bench_scripts.load("gemv_ceiling")


def test_every_variant_passes_its_check():
    variants = {"engine", "read", "read-tma", "gemv-tma"}
    if gc.TensorDescriptor is None:
        variants -= {"read-tma", "gemv-tma"}
    calls, checks = gc.shape_calls("o_proj", DEVICE, variants)
    kinds = {label.split(" (")[0] for label in checks}
    assert kinds == variants
    for label, err in checks.items():
        if isinstance(err, float):
            assert err <= 2e-2, label
        else:
            assert err == 0, label
    assert set(calls) == set(checks)


def test_the_read_check_sees_a_changed_word():
    w32 = torch.randint(-(2**31), 2**31 - 1, (32, 64), dtype=torch.int32, device=DEVICE)
    out = torch.empty(2, dtype=torch.int32, device=DEVICE)
    tile = (16, 256, 1, 2)
    want = gc.xor_ref(w32, 16)
    assert torch.equal(gc.read(w32, out, tile).cpu(), want)
    w32[17, 5] ^= 1 << 7  # one bit of the second tile's rows
    got = gc.read(w32, out, tile).cpu()
    assert got[0] == want[0] and got[1] != want[1]
