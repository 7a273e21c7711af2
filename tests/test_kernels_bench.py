"""``python -m kernels.bench`` as a script: on the CPU it runs in its smoke mode (Triton's
interpreter, one tiny point), so the harness, the sweeps and the JSON it writes are checked
here; its numbers only mean something on the GPU (docs/benchmarks/kernels.md)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke mode only")


def test_decode_grid_times_ours_and_sdpa_in_rounds(tmp_path, capsys):
    from kernels import bench

    out = tmp_path / "bench.json"
    bench.main(["--batches", "1", "--contexts", "256", "--prefill", "", "--json", str(out)])
    res = json.loads(out.read_text())
    (row,) = res["decode"]
    assert row["batch"] == 1 and row["context"] == 256
    assert len(row["ours_rounds"]) == bench.ROUNDS and len(row["sdpa_rounds"]) == bench.ROUNDS
    assert row["ours_us"] == pytest.approx(sorted(row["ours_rounds"])[bench.ROUNDS // 2])
    assert row["ours_us"] > 0 and row["sdpa_us"] > 0 and res["prefill"] == []
    kv_bytes = 2 * 256 * bench.HKV * bench.D * bench.DT.itemsize
    assert row["ours_gbs"] == pytest.approx(kv_bytes / row["ours_us"] / 1e3)
    assert row["ours_pct"] == pytest.approx(row["ours_gbs"] / res["copy_gbs"] * 100)
    table = capsys.readouterr().out
    assert "| ours µs | GB/s | % |" in table and "| 1 | 0K |" in table


def test_tuning_sweeps_time_every_variant(tmp_path):
    """The decode sweeps build DecodeTuning values (no module state to restore): every config
    and both PDL settings time at the smoke point."""
    from kernels import bench

    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "decode-config,pdl", "--json", str(out)])
    res = json.loads(out.read_text())["sweep"]
    got = {(r["sweep"], str(r["variant"])) for r in res}
    want = {("decode-config", str(list(c))) for c in bench.DECODE_CONFIGS}
    assert got == want | {("pdl", "none"), ("pdl", "pdl")}
    assert all(r["us"] and r["us"] > 0 for r in res), [r for r in res if not r["us"]]
