"""``python -m kernels.bench`` as a script: on the CPU it runs in its smoke mode (Triton's
interpreter, one tiny point), so the harness, the sweeps and the JSON it writes are checked
here; its numbers only mean something on the GPU (docs/benchmarks/kernels.md)."""

from __future__ import annotations

import itertools
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


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_tuning_sweeps_time_every_variant(tmp_path, kv):
    """The decode sweeps build DecodeTuning values (no module state to restore): every config
    (an fp8 cache's own list), every programs-per-SM variant and both PDL settings time at the
    smoke point."""
    from kernels import bench

    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "decode-config,per-sm,pdl", "--kv-dtype", kv, "--json", str(out)])
    res = json.loads(out.read_text())["sweep"]
    got = {(r["sweep"], str(r["variant"])) for r in res}
    configs = bench.FP8_DECODE_CONFIGS if kv == "fp8" else bench.DECODE_CONFIGS
    want = {("decode-config", str(list(c))) for c in configs}
    want |= {("per-sm", f"{c} x{p}") for c in bench.PER_SM_CONFIGS[kv]
             for p in bench.PER_SM_CHOICES}  # fmt: skip
    assert got == want | {("pdl", "none"), ("pdl", "pdl")}
    assert all(r["us"] and r["us"] > 0 for r in res), [r for r in res if not r["us"]]


@pytest.mark.parametrize("order", [[], ["--in-order"]], ids=["shuffled", "in-order"])
@pytest.mark.parametrize("which", ["splits", "decode-config"])
def test_split_and_tile_sweeps_time_their_variants_at_the_heads_and_page_given(
    tmp_path, monkeypatch, which, order
):
    """``--sweep splits|decode-config --heads 4/2 --page 32 [--in-order]``: splits times the
    heuristic's choice and every split count that fits, decode-config every tile of
    ``DECODE_CONFIGS`` (a DecodeTuning value); every call on a cache of the heads, page and
    page order asked for."""
    from kernels import bench

    seen = []
    real = bench.time_ours

    def spy(*args, **kw):
        tiles = kw["tuning"].tiles if kw.get("tuning") else None
        seen.append((kw.get("num_splits"), tiles, kw.get("hq"), kw.get("hkv"), kw.get("page"),
                     kw.get("shuffle")))  # fmt: skip
        return real(*args, **kw)

    monkeypatch.setattr(bench, "time_ours", spy)
    out = tmp_path / "sweep.json"
    bench.main(["--sweep", which, "--heads", "4/2", "--page", "32", "--points", "1x256",
                "--json", str(out), *order])  # fmt: skip
    res = json.loads(out.read_text())["sweep"]
    shuffle = not order
    if which == "splits":
        want = ["heuristic"] + [sp for sp in bench.SPLIT_CHOICES if sp * 64 <= 256]
        calls = [(None if v == "heuristic" else v, None, 4, 2, 32, shuffle) for v in want]
    else:
        want = [list(c) for c in bench.DECODE_CONFIGS]
        calls = [(None, tuple(c), 4, 2, 32, shuffle) for c in bench.DECODE_CONFIGS]
    assert [r["variant"] for r in res] == want
    assert all(r["us"] and r["us"] > 0 for r in res)
    assert seen == calls


def test_window_target_times_three_variants_per_point(tmp_path, capsys):
    """``--window``: decode per batch and prefill per chunk, each the global kernel and the
    windowed one at a context of W and the windowed one at the long context, with the ratios
    the target is read from, in the JSON and the table."""
    from kernels import bench

    out = tmp_path / "window.json"
    bench.main(["--window", "64", "--window-context", "256", "--batches", "1,2",
                "--window-chunks", "32", "--window-heads", "4/2/64", "--window-softcap", "30",
                "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["window"]
    assert [(r["kind"], r.get("batch", r.get("chunk"))) for r in rows] == [
        ("decode", 1), ("decode", 2), ("prefill", 32)
    ]  # fmt: skip
    for r in rows:
        assert r["heads"] == "4/2/64" and r["window"] == 64 and r["long_context"] == 256
        assert r["softcap"] == 30.0
        for v in bench.WINDOW_VARIANTS:
            assert len(r[f"{v}_rounds"]) == bench.ROUNDS and r[f"{v}_us"] > 0, (r, v)
        assert r["long_over_global_4k"] == pytest.approx(r["window_long_us"] / r["global_4k_us"])
        assert r["long_over_window_4k"] == pytest.approx(r["window_long_us"] / r["window_4k_us"])
    table = capsys.readouterr().out
    assert "| long / global | long / windowed |" in table and "| prefill | 4/2/64 | 32 |" in table


def test_window_inputs_hold_only_the_window_pages():
    """The windowed decode inputs: a pool of the last ``live`` tokens' pages per sequence, each
    used once, and a full-width block table whose entries left of them point into the pool."""
    from kernels import bench

    inp = bench.DecodeInputs(2, 256, 16, 1, 4, 2, d=64, live=72)  # pages 11..15 of 16
    q, pools, bt, _ = inp.sets[0]
    k = pools["k_cache"]
    assert k.shape == (2 * 5, 16, 2, 64) and bt.shape == (2, 16)
    assert sorted(bt[:, 11:].flatten().tolist()) == list(range(10))
    assert bt.min() >= 0 and bt.max() < 10


def test_decode_inputs_cover_a_partial_last_page():
    """A context that is not a multiple of the page gets a block-table entry (and a page) for
    its last, partial page; each page of the pool used once (a context of 32,800 at 128-token
    pages read past a 256-entry table on the GPU)."""
    from kernels import bench

    for ctx, page in ((100, 16), (129, 128), (64, 16)):
        width = -(-ctx // page)
        q, pools, bt, _ = bench.DecodeInputs(2, ctx, page, 1, 4, 2, d=64).sets[0]
        assert bt.shape == (2, width) and pools["k_cache"].shape[0] == 2 * width, (ctx, page)
        assert sorted(bt.flatten().tolist()) == list(range(2 * width)), (ctx, page)


def test_window_option_is_checked():
    from kernels import bench

    for argv in (["--window", "0"], ["--window", "100"], ["--window", "64", "--window-context",
                                                          "1000"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.main(argv)


def test_fp8_gemv_bench_times_every_layout(tmp_path):
    """``python -m kernels.bench_fp8``: bf16, fp8 per channel and fp8 blocks at each M, each
    checked against its own weight first; fp8 reads about half the bytes."""
    from kernels import bench_fp8

    out = tmp_path / "fp8.json"
    bench_fp8.main(["--shapes", "qkv", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    want = {(lay, m) for lay in bench_fp8.LAYOUTS for m in bench_fp8.MS}
    assert {(r["layout"], r["M"]) for r in rows} == want
    assert all(r["rel_err"] <= bench_fp8.MAX_ERR and r["pick_us"] > 0 for r in rows)
    size = {r["layout"]: r["bytes"] for r in rows if r["M"] == 1}
    assert size["fp8-channel"] < 0.6 * size["bf16"] and size["fp8-block"] < 0.6 * size["bf16"]


def test_fp8_gemv_sweep_covers_both_dot_kinds_and_splits():
    """``--sweep`` on a 132-SM GPU: the heuristic's pick first, mma.sync (1, 2 warps) and wgmma
    (4, 8) tiles, K splits where the N tiles are under one per SM only, no split shorter than
    one K tile, block scales only with BLOCK_N <= 128; at M <= 8 each tile with diag too."""
    from kernels import bench_fp8
    from kernels.gemv import gemv_config

    for layout, w_scale in (("fp8-channel", 1), ("fp8-block", 2)):
        for (n, k), m in itertools.product([(4096, 4096), (28672, 4096), (4096, 14336)], (1, 8)):
            cfgs = bench_fp8.configs(layout, m, n, k, 132, sweep=True)
            *pick, diag = gemv_config(m, n, k, 132, w_scale)
            assert cfgs[0] == (*pick, int(diag))
            assert len(set(cfgs)) == len(cfgs)
            # M <= 8: every tile with BLOCK_K >= 128 with diag too, the pick's included
            diag = {c[:5] for c in cfgs if c[5]}
            want = {c[:5] for c in cfgs if c[1] >= 128}
            assert diag == want, cfgs
            assert {c[3] for c in cfgs} >= {1, 2, 4, 8}, cfgs  # warps
            assert all(c[2] * c[1] <= k for c in cfgs)
            assert all(c[2] == 1 or -(-n // c[0]) < 132 or c == cfgs[0] for c in cfgs)
            if n == 4096:  # 32 to 256 tiles: split 2 and 4 timed beside unsplit
                assert {c[2] for c in cfgs} >= {1, 2, 4}, cfgs
            if layout == "fp8-block":
                assert all(c[0] <= 128 for c in cfgs), cfgs
    assert bench_fp8.configs("bf16", 1, 4096, 4096, 132, sweep=True) == [
        (*gemv_config(1, 4096, 4096, 132)[:5], 0)
    ]


def test_fp8_kv_grid_counts_the_bytes_it_reads(tmp_path, capsys):
    """``--kv-dtype fp8``: our decode and prefill (the portable kernel and the Hopper path)
    over e4m3 pools with their scales; ours GB/s count one byte a value plus a 2-byte scale per
    token and head, the peers' their own."""
    from kernels import bench

    out = tmp_path / "fp8.json"
    bench.main(["--batches", "1", "--contexts", "256", "--prefill", "256", "--kv-dtype", "fp8",
                "--json", str(out)])  # fmt: skip
    res = json.loads(out.read_text())
    assert res["meta"]["kv_dtype"] == "fp8"
    (row,) = res["decode"]
    fp8_bytes = 2 * 256 * bench.HKV * (bench.D + 2)
    assert row["kv_dtype"] == "fp8" and row["kv_mb"] == pytest.approx(fp8_bytes / 1e6)
    assert row["ours_gbs"] == pytest.approx(fp8_bytes / row["ours_us"] / 1e3)
    peer_bytes = 2 * 256 * bench.HKV * bench.D * bench.DT.itemsize
    assert row["sdpa_gbs"] == pytest.approx(peer_bytes / row["sdpa_us"] / 1e3)
    (pre,) = res["prefill"]
    assert pre["kv_dtype"] == "fp8" and pre["ours_page16_us"] > 0
    assert pre["hopper_page64_us"] > 0 and pre["hopper_page128_us"] > 0  # the Hopper path too
    assert pre["gluon_page64_us"] is None and pre["gluon_page128_us"] is None  # bf16 only
    assert "our KV cache: fp8" in capsys.readouterr().out
    pools = bench.kv_pools(3, 16, 2, 64, "fp8")
    assert pools["k_cache"].dtype == torch.float8_e4m3fn and pools["v_scale"].shape == (3, 2, 16)


def test_prefill_table_times_every_path_per_page(tmp_path, capsys):
    """The prefill table alone (``--batches ""``): ours portable (pages 16, 64, 128), the
    Hopper path and the Gluon kernel (pages 64, 128) beside SDPA's backends, in the JSON and
    the table. The Gluon kernel runs on sm_90 only: on the CPU its columns stay empty."""
    from kernels import bench

    out = tmp_path / "prefill.json"
    bench.main(["--batches", "", "--prefill", "256", "--json", str(out)])  # prefill only
    res = json.loads(out.read_text())
    (pre,) = res["prefill"]
    assert res["decode"] == []
    for name, _, path in bench.PREFILL_COLUMNS:
        if path == "gluon":
            assert pre[f"{name}_us"] is None and pre[f"{name}_tflops"] is None, name
        else:
            assert pre[f"{name}_us"] > 0 and pre[f"{name}_tflops"] > 0, name
    table = capsys.readouterr().out
    assert "| hopper p64 µs | TFLOP/s | hopper p128 µs |" in table
    assert "| gluon p64 µs | TFLOP/s | gluon p128 µs |" in table


def test_hopper_sweep_times_every_config_that_fits_the_page(tmp_path):
    from kernels import bench

    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "hopper", "--json", str(out)])
    res = json.loads(out.read_text())["sweep"]
    want = ["portable"] + [list(c) for c in bench.HOPPER_CONFIGS[64] if c[1] <= 64]
    assert [r["variant"][2] for r in res] == want
    assert all(r["us"] > 0 and r["variant"][:2] == [64, 64] for r in res)


def test_gluon_sweep_lists_every_config_that_fits_the_page(tmp_path):
    """The Gluon sweep's variants: the Hopper path's default, then each ``GLUON_CONFIGS``
    value that fits the page (on the CPU only the Hopper path runs: the Gluon kernel needs
    sm_90, and its attempts leave no time)."""
    import dataclasses

    from kernels import bench

    out = tmp_path / "sweep.json"
    bench.main(["--sweep", "gluon", "--json", str(out)])
    res = json.loads(out.read_text())["sweep"]
    want = ["hopper"] + [list(dataclasses.astuple(c)) for c in bench.GLUON_CONFIGS[64]
                         if c.block_n <= 64]  # fmt: skip
    assert [r["variant"][2] for r in res] == want
    assert res[0]["us"] > 0 and all(r["us"] is None for r in res[1:])
