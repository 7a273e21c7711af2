"""docs/benchmarks/decode_ceiling.py's read kernel gives what the benchmark checks it against
before timing it: per (sequence, split), the xor of its pages' K and V words and scales, pages
looked up in a shuffled block table, the last split short. Without a GPU it runs in Triton's
interpreter (conftest.py), at the script's toy sizes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not importable on this machine")

import bench_scripts  # noqa: E402

dc = bench_scripts.load("decode_ceiling")


@pytest.mark.parametrize("splits", [1, 3, 4])
def test_the_read_kernel_xors_each_splits_pages(splits):
    from kernels.bench import DEV, DecodeInputs

    ctx = 10 * dc.PAGE - 5  # 10 pages, the last partial: splits of 10, 4 + 4 + 2, 3 x 3 + 1
    inp = DecodeInputs(2, ctx, dc.PAGE, 1, 4, 1, True, dc.D, kv="fp8")
    _, pools, bt, _ = inp.sets[0]
    out = torch.empty(2, splits, device=DEV, dtype=torch.int32)
    want = dc.read_ref(pools, bt, splits)
    assert torch.equal(dc.read_pages(pools, bt, out, (splits, 1, 2)).cpu(), want)
    pools["v_scale"].view(torch.int16).view(-1)[0] ^= 1  # one bit of page 0's scales
    hit = (bt.cpu() == 0).nonzero()  # where page 0 is read: one split changes
    assert len(hit) == 1
    got = dc.read_pages(pools, bt, out, (splits, 1, 2)).cpu()
    per_split = -(-bt.shape[1] // splits)
    for b, p in hit.tolist():
        assert got[b, p // per_split] != want[b, p // per_split]
    assert int((got != want).sum()) == len(hit)
