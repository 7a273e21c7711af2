"""``python -m kernels.bench_gemv --gated`` as a script: on the CPU it runs in its smoke mode
(Triton's interpreter, toy shapes), so the harness and the JSON it writes are checked here; its
numbers only mean something on the GPU."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode only")


def test_gated_times_gemv_unfused_and_fused(tmp_path, capsys):
    from kernels import bench_gemv

    out = tmp_path / "gated.json"
    bench_gemv.main(["--gated", "--scales", "none,block", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["scales"]) for r in rows] == [
        (name, s) for name in bench_gemv.GATED_SHAPES for s in ("none", "block")
    ]
    for r in rows:
        assert min(r["gemv_us"], r["unfused_us"], r["fused_us"]) > 0, r
        assert r["saved_us"] == pytest.approx(r["unfused_us"] - r["fused_us"])
        assert r["fused_vs_unfused_rel_err"] < 2e-3, r  # fp16 here: both round to it
    assert "unfused" in capsys.readouterr().out
