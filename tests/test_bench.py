"""The measuring tools on a CPU: ``bench decode`` on dummy:tiny beside transformers, and
``bench serve`` against a real server process. These check that the tools measure and
report correctly, not how fast anything is."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import random
import time

import httpx
import pytest
import torch
from server_utils import free_port, server_process

from flashserve.bench.decode import parse_sizes
from flashserve.bench.prompts import load_tokenizer, make_prompt, sample_lengths
from flashserve.bench.report import percentiles
from flashserve.cli.main import main


def _filled(obj, path: str = "") -> list[str]:
    """Paths of every None (or NaN) leaf in a JSON object."""
    if obj is None or (isinstance(obj, float) and math.isnan(obj)):
        return [path]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _filled(v, f"{path}.{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _filled(v, f"{path}[{i}]")]
    return []


def _ordered(dist: dict) -> bool:
    return dist["p50"] <= dist["p90"] <= dist["p99"]


# ---- helpers -------------------------------------------------------------------------------


def test_percentiles_interpolate_and_order():
    xs = random.sample(range(1000), 101)
    p = percentiles(xs)
    assert p["p50"] == sorted(xs)[50]
    assert _ordered(p) and p["p99"] <= max(xs)
    assert percentiles([3.0]) == {"p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_parse_sizes():
    assert parse_sizes("4096, 32k,128K") == [4096, 32768, 131072]
    with pytest.raises(Exception, match="sizes"):
        parse_sizes("4096,x")


def test_prompts_have_the_asked_token_counts():
    tok = load_tokenizer("dummy:tiny")
    rng = random.Random(0)
    lens = sample_lengths(100, 0.5, 50, rng)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 10
    for n in (1, 7, 100, 1000):
        assert len(tok.encode(make_prompt(n, rng, tok))) == n


def test_prompts_sized_by_the_default_model_named_as_info_names_it():
    """A server on the default model reports its GGUF's stem in /info; bench serve must find
    that tokenizer rather than estimate prompt lengths."""
    from flashserve.loaders.load import DEFAULT_FILE, default_model_path
    from flashserve.tokenizer.tokenizer import Tokenizer

    tok = load_tokenizer(DEFAULT_FILE.removesuffix(".gguf"))
    reference = Tokenizer.from_gguf(default_model_path())
    text = make_prompt(300, random.Random(1), tok)
    assert len(tok.encode(text)) == 300
    assert tok.encode(text) == reference.encode(text)
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer("SmolLM2-135M-Instruct")


# ---- bench decode --------------------------------------------------------------------------


def _plot_args(path) -> list[str]:
    """``--plot path`` where matplotlib is installed (it is optional)."""
    return ["--plot", str(path)] if importlib.util.find_spec("matplotlib") else []


def _assert_png(args: list[str]) -> None:
    if args:
        with open(args[1], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_decode_json_with_peer(tmp_path, capsys):
    out, plot = tmp_path / "decode.json", _plot_args(tmp_path / "decode.png")
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "32,80",
            "--batch", "1,3", "--steps", "4", "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv + plot) == 0
    _assert_png(plot)
    res = json.loads(out.read_text())
    assert _filled({k: v for k, v in res["meta"].items() if k != "peer_note"}) == []
    meta = res["meta"]
    assert meta["peer"].startswith("transformers") and meta["copy_bandwidth_gbs"] > 0
    points = res["points"]
    assert [(p["context"], p["batch"]) for p in points] == [(32, 1), (32, 3), (80, 1), (80, 3)]
    for p in points:
        where = f"context {p['context']}, batch {p['batch']}"
        assert p["status"] == "ok", where
        assert _filled({k: v for k, v in p.items() if not k.endswith("note")}) == [], where
        ours, peer = p["ours"], p["peer"]
        # each sequence holds its prompt plus at least one generated token when a step reads
        assert ours["kv_tokens_per_step"] >= p["batch"] * (p["context"] + 1), where
        want = meta["weight_bytes_read"] + ours["kv_tokens_per_step"] * meta["kv_bytes_per_token"]
        assert p["bytes_per_step"] == pytest.approx(want)
        for m in (ours, peer):
            assert 0 < m["roofline_percent"] <= 150, where
            assert m["tokens_per_s"] == pytest.approx(p["batch"] * m["tokens_per_s_per_seq"])
            assert m["ms_per_step"] == pytest.approx(1e3 / m["tokens_per_s_per_seq"])
            assert m["peak_memory_bytes"] > 0
        assert p["ours_over_peer"] == pytest.approx(peer["step_s"] / ours["step_s"])
    table = capsys.readouterr().out
    assert "tok/s/seq" in table and "ours/peer" in table


def test_bench_decode_with_async_scheduling(tmp_path):
    """Decode steps queued ahead hand their outputs over one step() later: the timed loop still
    sees a full batch of tokens per step, and the run says it used the option."""
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "40",
            "--batch", "1,4", "--steps", "5", "--no-peer", "--async-scheduling",
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["async_scheduling"] is True
    assert res["meta"]["pdl_chain"] is False  # CUDA sm_90+ only
    assert [p["status"] for p in res["points"]] == ["ok", "ok"]
    assert all(p["ours"]["tokens_per_s"] > 0 for p in res["points"])


def test_bench_decode_on_two_tensor_parallel_ranks(tmp_path):
    """The bytes and the roofline are rank 0's: its half of the projections and of the LM
    head, the norms whole (dummy:tiny: 2 layers, hidden 64, q 64 + k, v 32 each, MLP 128, an
    untied vocabulary of 512), its one KV head of two; async scheduling's look-ahead steps
    run on both ranks; no peer."""
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "40",
            "--batch", "1,2", "--steps", "4", "--async-scheduling", "--tensor-parallel-size",
            "2", "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    meta = res["meta"]
    assert meta["tensor_parallel_size"] == 2 and meta["peer"] is None
    assert "tensor parallel" in meta["peer_note"]
    layer = 64 * (64 + 2 * 32) // 2 + 64 * 64 // 2 + 3 * 64 * 128 // 2 + 2 * 64
    assert meta["weight_bytes_read"] == 4 * (2 * layer + 64 + 512 * 64 // 2)
    assert meta["kv_bytes_per_token"] == 4 * 2 * 2 * 1 * 16  # fp32, K and V, 2 layers, 1 head
    assert [p["status"] for p in res["points"]] == ["ok", "ok"]
    # the collectives, timed first on two gloo ranks, are in each point's roofline
    comm = {int(b): s for b, s in meta["collectives_s_per_step"].items()}
    assert set(comm) == {1, 2} and all(s > 0 for s in comm.values())
    for p in res["points"]:
        roof = p["roofline"]
        assert roof["collectives_ms_per_step"] == pytest.approx(comm[p["batch"]] * 1e3)
        by_bytes = p["bytes_per_step"] / (meta["copy_bandwidth_gbs"] * 1e9)
        assert roof["ms_per_step"] == pytest.approx((by_bytes + comm[p["batch"]]) * 1e3)


def test_step_collectives_of_a_70b_split_over_two_ranks():
    from flashserve.bench.collectives import StepCollectives
    from flashserve.models.presets import preset_config

    shape = StepCollectives.of(preset_config("llama3.1-70b"), 2, torch.bfloat16)
    assert (shape.hidden, shape.all_reduces, shape.vocab_rows) == (8192, 2 * 80, 64128)
    assert shape.all_reduces_at(1) == shape.all_reduces_at(64) == 160
    # --tp-all-reduce fused: decode-sized steps keep no all-reduce (the embeddings are whole)
    folded = StepCollectives.of(preset_config("llama3.1-70b"), 2, torch.bfloat16, "fused")
    assert (folded.all_reduces_at(1), folded.all_reduces_at(16), folded.all_reduces_at(17)) == (
        0, 0, 160)  # fmt: skip


def test_timing_collectives_names_the_rank_that_failed():
    """Ranks that cannot join (no CUDA here) end the timing with the reason, not a hang."""
    from flashserve.bench.collectives import StepCollectives, time_step_collectives

    shape = StepCollectives(hidden=8, layers=1, vocab_rows=4, dtype=torch.float32, size=2)
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(RuntimeError, match=r"collectives failed: rank \d: "):
        time_step_collectives("cuda", shape, [1])


def test_bench_decode_on_two_ranks_counts_fp8_bytes(tmp_path):
    """fp8 weights and KV cache on two ranks: rank 0's projections at a byte a weight plus
    float32 scales (one per output row it holds: o_proj's and down_proj's whole, as their
    rows are), the rest float32; its one KV head's fp8 K and V plus a bf16 scale each."""
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "40",
            "--batch", "1", "--steps", "2", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
            "--tensor-parallel-size", "2", "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["tensor_parallel_size"] == 2 and meta["kv_cache_dtype"] == "fp8"
    assert "projections float8 e4m3" in meta["weights"] and "rank 0 of 2" in meta["weights"]
    rows = (64 + 2 * 32) // 2 + 64 + 2 * 128 // 2 + 64  # qkv, o, gate_up, down
    fp8 = 64 * (64 + 2 * 32) // 2 + 64 * 64 // 2 + 3 * 64 * 128 // 2  # one byte each
    layer = fp8 + 4 * rows + 4 * 2 * 64  # scales, norms
    assert meta["weight_bytes_read"] == 2 * layer + 4 * (64 + 512 * 64 // 2)
    assert meta["kv_bytes_per_token"] == 2 * 2 * 1 * (16 + 2)  # 2 layers, K and V, 1 head


def test_bench_decode_skips_points_that_do_not_fit(tmp_path, capsys):
    out = tmp_path / "decode.json"
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "16,600",
            "--batch", "1", "--steps", "2", "--max-kv-tokens", "256", "--no-peer",
            "--gpu-memory-utilization", "0.5", "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    # the run records what sized its pool (the share only counts on CUDA)
    assert res["meta"]["kv_pool_tokens"] == 256
    assert res["meta"]["gpu_memory_utilization"] == 0.5
    small, big = res["points"]
    assert small["status"] == "ok" and small["ours"]["tokens_per_s"] > 0
    assert small["peer"] is None and res["meta"]["peer_note"] == "--no-peer"
    assert big["status"] == "skipped" and big["ours"] is None
    assert "KV" in big["note"] or "max model len" in big["note"]
    assert "skipped" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, expected", [([], 0.90), (["--gpu-memory-utilization", "0.93"], 0.93)]
)
def test_bench_decode_and_serve_take_gpu_memory_utilization(flag, expected):
    """vLLM's option, shared by every engine command (``add_engine_args``): the share of GPU
    memory the KV pool is sized from (Gemma 3 12B at 128K needs 0.93 on an H100)."""
    from flashserve.bench.decode import _engine_config
    from flashserve.cli.args import engine_config_from_args
    from flashserve.cli.main import build_parser
    from server.cli import SERVE

    parser = build_parser([SERVE])
    args = parser.parse_args(["bench", "decode", "--device", "cpu", *flag])
    assert _engine_config(args).gpu_memory_utilization == expected
    args = parser.parse_args(["serve", "--device", "cpu", *flag])
    assert engine_config_from_args(args).gpu_memory_utilization == expected


def test_bench_decode_refuses_a_memory_share_over_one(capsys):
    argv = ["bench", "decode", "--device", "cpu", "--gpu-memory-utilization", "1.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "gpu_memory_utilization must be in (0, 1]" in err and "Traceback" not in err


def test_bench_plot_without_matplotlib_fails_before_running(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu",
            "--plot", str(tmp_path / "x.png")]  # fmt: skip
    assert main(argv) == 2
    assert "matplotlib" in capsys.readouterr().err


# ---- bench prefill -------------------------------------------------------------------------


def test_bench_prefill_json_with_peer(tmp_path, capsys):
    """Chunked prefill (a 16-token budget cuts the 40-token prompt in three) beside transformers:
    every field filled, the medians, rates and ratio derived from the recorded times."""
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--model", "dummy:tiny", "--device", "cpu", "--tokens", "9,40",
            "--rounds", "3", "--max-num-batched-tokens", "16", "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    meta = res["meta"]
    assert _filled({k: v for k, v in meta.items() if k != "peer_note"}) == []
    assert meta["peer"].startswith("transformers") and meta["peer_note"] is None
    assert (meta["max_num_batched_tokens"], meta["rounds"], meta["dtype"]) == (16, 3, "float32")
    assert meta["threads"] == torch.get_num_threads() and meta["attention_backend"] == "torch"
    assert meta["cpu_model"] and meta["device"] == "cpu"
    assert [p["tokens"] for p in res["points"]] == [9, 40]
    for p in res["points"]:
        assert p["status"] == "ok" and p["note"] is None and p["peer_note"] is None
        for side in (p["ours"], p["peer"]):
            assert len(side["times_s"]) == 3 and min(side["times_s"]) > 0
            assert side["median_s"] == sorted(side["times_s"])[1]
            assert side["tokens_per_s"] == pytest.approx(p["tokens"] / side["median_s"])
        assert p["ratio"] == pytest.approx(p["ours"]["median_s"] / p["peer"]["median_s"])
        assert p["peak_memory_bytes"] > 0
        assert p["ours"]["tflops"] == pytest.approx(
            p["flops"]["total"] / p["ours"]["median_s"] / 1e12
        )
    table = capsys.readouterr().out
    assert "transformers s" in table and "ratio (ours/tf)" in table and "ours TFLOP/s" in table
    assert table.splitlines()[2].split()[0] == "9"


def test_prefill_flops_counts_the_issue_s_way():
    """Llama-3-8B at 32,768 tokens: 7.39e14 FLOPs (1.44 s was 513 TFLOP/s in issue 17), the
    attention 38% of them; a window counts only the keys each query sees, by brute force."""
    from flashserve.bench.prefill import _pairs, prefill_flops
    from flashserve.models.presets import preset_config

    flops = prefill_flops(preset_config("llama3.1-8b"), 32768)
    assert flops["total"] / 1.44 / 1e12 == pytest.approx(513, abs=1)
    assert flops["attention"] / flops["total"] == pytest.approx(0.38, abs=0.005)
    for n, w in ((1, 0), (7, 0), (10, 3), (10, 10), (10, 40), (33, 8)):
        brute = sum(min(i + 1, w) if w else i + 1 for i in range(n))
        assert _pairs(n, w) == brute, (n, w)


def test_bench_prefill_without_peer_skips_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    argv = ["bench", "prefill", "--model", "dummy:tiny", "--device", "cpu", "--tokens", "8,100",
            "--rounds", "1", "--max-model-len", "64", "--no-peer", "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["peer"] is None and res["meta"]["peer_note"] == "--no-peer"
    short, long = res["points"]
    assert short["status"] == "ok" and short["ours"]["median_s"] > 0
    assert short["peer"] is None and short["ratio"] is None
    assert long["status"] == "skipped" and long["ours"] is None
    assert "max model len 64" in long["note"]
    assert "100 tokens: over max model len 64" in capsys.readouterr().out


def test_bench_prefill_profile_writes_trace_tables_per_length(tmp_path):
    """``--profile DIR``: one more prefill of each length under the profiler, its trace, its
    ops table and its kernel table in DIR (per prefill), the summary in the point."""
    out, prof = tmp_path / "prefill.json", tmp_path / "prof"
    n = random.randint(20, 60)
    argv = ["bench", "prefill", "--model", "dummy:tiny", "--device", "cpu", "--tokens", str(n),
            "--rounds", "1", "--no-peer", "--profile", str(prof), "--json", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (point,) = json.loads(out.read_text())["points"]
    summary = point["profile"]
    assert json.loads((prof / f"prefill-{n}.json").read_text())["traceEvents"]
    table = (prof / f"prefill-{n}.txt").read_text()
    assert table.startswith("1 prefill, ") and "aten::" in table
    launches = (prof / f"prefill-{n}-launches.txt").read_text().splitlines()
    assert launches[0] == table.splitlines()[0] and "calls/prefill" in launches[1]
    assert summary["wall_us_per_prefill"] > 0 and summary["launches"].endswith("launches.txt")


def test_bench_prefill_rejects_zero_rounds(capsys):
    argv = ["bench", "prefill", "--model", "dummy:tiny", "--device", "cpu", "--rounds", "0"]
    assert main(argv) == 2
    assert "--rounds" in capsys.readouterr().err


# ---- bench serve ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url():
    with server_process("--model", "dummy:tiny", "--max-model-len", "1024") as base:
        yield base


def _serve(url: str, tmp_path, *args: str) -> dict:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--url", url, "--json", str(out), "--no-progress", "--seed", "3"]
    assert main([*argv, *args]) == 0
    return json.loads(out.read_text())


def _check_latencies(res: dict) -> None:
    for name, dist in res["latency_ms"].items():
        assert _filled(dist) == [], name
        assert _ordered(dist) and dist["p50"] > 0, name
    assert _ordered(res["decode_tokens_per_s"])
    s = res["summary"]
    assert s["request_throughput"] > 0 and s["output_token_throughput"] > 0
    assert s["total_token_throughput"] > s["output_token_throughput"]


def test_bench_serve_tgi_fixed_concurrency(url, tmp_path, capsys):
    res = _serve(url, tmp_path, "--num-requests", "8", "--concurrency", "4",
                 "--input-len", "60", "--input-len-range", "0.5", "--output-len", "12")  # fmt: skip
    s = res["summary"]
    assert (s["requests"], s["completed"], s["failed"], s["failures"]) == (8, 8, 0, {})
    assert res["tokenizer"] == "dummy:tiny"  # found through /info: exact prompt lengths
    for r in res["requests"]:
        assert r["prompt_tokens"] == r["input_len"] and 30 <= r["input_len"] <= 90
        assert r["token_events"] == r["output_tokens"]  # TGI: one event per token
        if r["finish_reason"] == "length":  # TGI has no ignore_eos: EOS may end one early
            assert r["output_tokens"] == 12
        assert len(r["itl_ms"]) == r["token_events"] - 1
        assert r["ttft_ms"] <= r["e2e_ms"]
    assert s["output_tokens"] == sum(r["output_tokens"] for r in res["requests"])
    _check_latencies(res)
    assert "time to first token" in capsys.readouterr().out


def test_bench_serve_poisson_arrivals(url, tmp_path):
    plot = _plot_args(tmp_path / "cdf.png")
    res = _serve(url, tmp_path, "--num-requests", "6", "--request-rate", "40",
                 "--input-len", "20", "--output-len", "6", *plot)  # fmt: skip
    _assert_png(plot)
    assert res["meta"]["server_info"]["model_id"] == "dummy:tiny"
    s = res["summary"]
    assert (s["completed"], s["failed"]) == (6, 0)
    _check_latencies(res)


def test_bench_serve_decode_at_depth(url, tmp_path):
    res = _serve(url, tmp_path, "--depth", "700", "--output-len", "24")
    (r,) = res["requests"]
    assert r["status"] == "ok" and r["prompt_tokens"] == 700
    assert r["decode_tokens_per_s"] > 0 and r["ttft_ms"] > 0
    assert res["decode_tokens_per_s"]["p50"] == pytest.approx(r["decode_tokens_per_s"])


def test_bench_serve_openai(url, tmp_path):
    if httpx.get(f"{url}/v1/models").status_code != 200:
        pytest.skip("this server has no OpenAI routes")
    res = _serve(url, tmp_path, "--api", "openai", "--num-requests", "4", "--concurrency", "2",
                 "--input-len", "40", "--output-len", "10")  # fmt: skip
    s = res["summary"]
    assert (s["completed"], s["failed"], s["early_stops"]) == (4, 0, 0)
    for r in res["requests"]:  # ignore_eos: exact lengths; usage gives the token counts
        assert (r["prompt_tokens"], r["output_tokens"]) == (40, 10)
        assert 1 <= r["token_events"] <= 10
    _check_latencies(res)


def test_bench_serve_stops_at_max_duration(url, tmp_path):
    # one request at a time, each ~100+ decode steps: the 1 s bound cuts the run short
    res = _serve(url, tmp_path, "--num-requests", "20", "--concurrency", "1",
                 "--input-len", "8", "--output-len", "400", "--max-duration", "1")  # fmt: skip
    s = res["summary"]
    assert s["cancelled"] >= 1 and s["completed"] + s["cancelled"] == 20
    assert s["failed"] == 0 and s["duration_s"] < 5


def test_bench_serve_counts_failures_by_status(url, tmp_path):
    # a prompt longer than the context (1024) is refused with 422 by every request
    res = _serve(url, tmp_path, "--num-requests", "3", "--input-len", "2000", "--output-len", "4")
    s = res["summary"]
    assert (s["completed"], s["failed"], s["failures"]) == (0, 3, {"http_422": 3})
    assert all("validation" in r["error"] for r in res["requests"])


def test_bench_serve_duration_samples_server_metrics(url, tmp_path, capsys):
    plot = _plot_args(tmp_path / "soak.png")
    res = _serve(url, tmp_path, "--duration", "3", "--sample-metrics", "0.5", "--request-rate",
                 "10", "--input-len", "20", "--output-len", "6", *plot)  # fmt: skip
    _assert_png(plot)
    s = res["summary"]
    assert s["requests"] == s["completed"] > 5 and s["all_completed"]
    assert 3 <= s["duration_s"] < 3 + res["latency_ms"]["e2e"]["p99"] / 1e3 + 1
    m = res["server_metrics"]
    assert (m["failed_scrapes"], m["error"]) == (0, None)
    samples = m["samples"]
    assert m["scrapes"] == len(samples) >= 6
    ts = [x["t"] for x in samples]
    assert ts == sorted(ts) and ts[0] < 0.5 and ts[-1] >= s["duration_s"]
    for x in samples:  # on a CPU: no GPU gauges
        assert set(x) == {"t", "resident_memory_bytes", "running", "waiting", "kv_cache_usage"}
        assert x["resident_memory_bytes"] > 0
    assert samples[-1]["running"] == 0  # the last sample comes after the run
    assert set(m["memory"]) == {"resident_memory_bytes"}
    rss = m["memory"]["resident_memory_bytes"]
    assert _filled(rss) == [] and rss["max"] >= max(rss["first"], rss["last"])
    assert 0.3 <= rss["warm_t"] < 1.5  # the first sample after 10% of the run
    assert rss["drift_mib"] == pytest.approx((rss["last"] - rss["warm"]) / 2**20)
    assert rss["drift_percent"] == pytest.approx(100 * (rss["last"] - rss["warm"]) / rss["warm"])
    assert set(m["load"]) == {"running", "waiting", "kv_cache_usage"}
    out = capsys.readouterr().out
    assert "resident memory" in out and "drift %" in out
    assert out.rstrip().endswith(f"ALL {s['requests']} REQUESTS COMPLETED: no failure")


def test_bench_serve_duration_stops_sending(url, tmp_path):
    # one ~0.3 s request at a time: after 2 s no new one starts, the one in flight finishes
    res = _serve(url, tmp_path, "--duration", "2", "--concurrency", "1",
                 "--input-len", "8", "--output-len", "60")  # fmt: skip
    s, e2e = res["summary"], res["latency_ms"]["e2e"]
    assert s["all_completed"] and s["cancelled"] == 0
    # a second request starts when the first ends inside the 2 s (a loaded machine took 3 s
    # for one: 52 ms a token)
    assert s["requests"] >= 2 or e2e["p50"] >= 2000, (s, e2e)
    assert 2 <= s["duration_s"] < 2 + e2e["p99"] / 1e3 + 0.5
    # back to back: the requests' own time fills the run
    assert sum(r["e2e_ms"] for r in res["requests"]) / 1e3 > 0.8 * s["duration_s"]


def test_bench_serve_duration_excludes_num_requests(capsys):
    argv = ["bench", "serve", "--url", "http://127.0.0.1:9", "--duration", "5",
            "--num-requests", "10"]  # fmt: skip
    assert main(argv) == 2
    assert "--duration or --num-requests" in capsys.readouterr().err


def test_bench_serve_goes_on_when_metrics_cannot_be_read(url, tmp_path, monkeypatch, capsys):
    from flashserve.bench import server_metrics

    real_init = server_metrics.MetricsSampler.__init__
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setattr(server_metrics.MetricsSampler, "__init__",
                        lambda self, _, period: real_init(self, nowhere, period))  # fmt: skip
    res = _serve(url, tmp_path, "--num-requests", "3", "--sample-metrics", "0.2",
                 "--input-len", "8", "--output-len", "4")  # fmt: skip
    assert res["summary"]["completed"] == 3
    m = res["server_metrics"]
    assert m["samples"] == [] and m["memory"] == {} and m["failed_scrapes"] == m["scrapes"] >= 1
    assert "ConnectError" in m["error"]
    assert f"0 of {m['scrapes']} scrapes read" in capsys.readouterr().out


def test_bench_decode_profile_writes_trace_and_table(tmp_path):
    out, prof = tmp_path / "decode.json", tmp_path / "prof"
    argv = ["bench", "decode", "--model", "dummy:tiny", "--device", "cpu", "--context", "24",
            "--batch", "2", "--steps", "3", "--no-peer", "--profile", str(prof),
            "--json", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    (point,) = json.loads(out.read_text())["points"]
    summary = point["profile"]
    trace = json.loads((prof / "decode-24x2.json").read_text())
    assert trace["traceEvents"], "an empty trace"
    table = (prof / "decode-24x2.txt").read_text()
    assert table.startswith("8 decode steps") and "aten::" in table
    assert summary["wall_us_per_step"] > 0 and summary["table"].endswith("decode-24x2.txt")


def test_metrics_sampler_does_not_reuse_a_connection_the_server_may_be_closing():
    """A server that drops a kept-alive connection when a second request arrives on it (what a
    keep-alive timeout does to a request sent at the wrong moment): every scrape still reads,
    because each goes out on a connection of its own."""
    import socket
    import threading

    from flashserve.bench.server_metrics import MetricsSampler

    body = b"flashserve_num_requests_running 3.0\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_one(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                if not (chunk := conn.recv(4096)):
                    return
                data += chunk
            conn.sendall(head + body)
            conn.recv(4096)  # a second request on this connection: close without an answer

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()

    async def run() -> dict:
        sampler = MetricsSampler(f"http://127.0.0.1:{port}", 0.05)
        sampler.start(time.perf_counter())
        await asyncio.sleep(0.3)
        await sampler.stop()
        return sampler.result(0.3)

    try:
        m = asyncio.run(run())
    finally:
        listener.close()
    assert m["scrapes"] >= 4 and m["failed_scrapes"] == 0, m["error"]
    assert {s["running"] for s in m["samples"]} == {3.0}


# ---- bench serve: workloads that reuse context ---------------------------------------------


def _capture_sends(monkeypatch) -> list[tuple[str, object]]:
    """(prompt, record) of every request bench serve sends, in the order sent; the record is
    the one the run fills (answer text, times)."""
    from flashserve.bench import client

    sent, real_send = [], client.send

    async def send(http, url, api, prompt, rec, model=None):
        sent.append((prompt, rec))
        return await real_send(http, url, api, prompt, rec, model)

    monkeypatch.setattr(client, "send", send)
    return sent


def test_extend_prompt_keeps_the_prefix_tokens_and_adds_the_asked_count():
    from flashserve.bench.prompts import extend_prompt
    from flashserve.loaders.load import DEFAULT_FILE

    for spec in ("dummy:tiny", DEFAULT_FILE.removesuffix(".gguf")):  # byte-level, GGUF BPE
        tok, rng = load_tokenizer(spec), random.Random(5)
        prefix = make_prompt(rng.randint(50, 400), rng, tok)
        base = tok.encode(prefix)
        for n in (1, 3, 64, 301):
            suffix, count = extend_prompt(prefix, n, rng, tok)
            ids = tok.encode(prefix + suffix)
            assert (len(ids), count) == (len(base) + n, len(base) + n), (spec, n)
            assert ids[: len(base)] == base, (spec, n)


def test_bench_serve_shared_prefix(url, tmp_path, monkeypatch, capsys):
    sent = _capture_sends(monkeypatch)
    docs, doc_len, questions, q_len = 3, 150, 8, 12
    res = _serve(url, tmp_path, "--workload", "shared-prefix", "--documents", str(docs),
                 "--document-len", str(doc_len), "--questions", str(questions), "--question-len",
                 str(q_len), "--output-len", "4", "--concurrency", "3")  # fmt: skip
    s = res["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (questions, questions, 0)
    assert res["workload"] == {
        "name": "shared-prefix", "documents": docs, "document_len": doc_len,
        "questions": questions, "question_len": q_len, "prompt_len": doc_len + q_len,
        "output_len": 4, "output_len_range": 0.0, "ttft_ms": res["workload"]["ttft_ms"],
    }  # fmt: skip
    split = res["workload"]["ttft_ms"]
    assert (split["cold"]["requests"], split["reused"]["requests"]) == (docs, questions - docs)
    assert all(_ordered(d) and d["p50"] > 0 for d in split.values())
    _check_latencies(res)

    tok = load_tokenizer("dummy:tiny")
    assert len(sent) == questions
    # documents interleave: question j asks about document j mod K, in the order sent
    assert [rec.tags["document"] for _, rec in sent] == [j % docs for j in range(questions)]
    ids = [tok.encode(prompt) for prompt, _ in sent]
    assert all(len(x) == doc_len + q_len for x in ids)
    for d in range(docs):
        mine = [x for j, x in enumerate(ids) if j % docs == d]
        assert all(x[:doc_len] == mine[0][:doc_len] for x in mine)  # one document, token-exact
        assert len({tuple(x[doc_len:]) for x in mine}) == len(mine)  # different questions
    assert len({tuple(x[:doc_len]) for x in ids}) == docs  # different documents
    for r in res["requests"]:  # the server counts what was asked
        assert r["prompt_tokens"] == r["input_len"] == doc_len + q_len
        assert r["tags"]["cold"] == (r["tags"]["question"] < docs)
    out = capsys.readouterr().out
    assert "workload shared-prefix: documents 3" in out and "reused (5 requests)" in out


def test_bench_serve_shared_prefix_without_questions_repeats_each_document(
    url, tmp_path, monkeypatch
):
    """``--question-len 0``: each request is its document alone, the same text again."""
    sent = _capture_sends(monkeypatch)
    docs, doc_len, questions = 2, 120, 5
    res = _serve(url, tmp_path, "--workload", "shared-prefix", "--documents", str(docs),
                 "--document-len", str(doc_len), "--questions", str(questions),
                 "--question-len", "0", "--output-len", "2", "--concurrency", "1")  # fmt: skip
    s = res["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (questions, questions, 0)
    assert res["workload"]["prompt_len"] == doc_len
    prompts = [prompt for prompt, _ in sent]
    assert len(set(prompts)) == docs
    assert all(prompts[j] == prompts[j % docs] for j in range(questions))
    tok = load_tokenizer("dummy:tiny")
    assert all(len(tok.encode(p)) == doc_len for p in prompts)
    for r in res["requests"]:
        assert r["prompt_tokens"] == r["input_len"] == doc_len


@pytest.mark.parametrize("api", ["tgi", "openai"])
def test_bench_serve_multi_turn(url, tmp_path, monkeypatch, api):
    if api == "openai" and httpx.get(f"{url}/v1/models").status_code != 200:
        pytest.skip("this server has no OpenAI routes")
    sent = _capture_sends(monkeypatch)
    chats, turns, first, turn_len = 3, 3, 30, 10
    res = _serve(url, tmp_path, "--api", api, "--workload", "multi-turn",
                 "--conversations", str(chats), "--turns", str(turns), "--input-len", str(first),
                 "--turn-len", str(turn_len), "--output-len", "5")  # fmt: skip
    s = res["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (chats * turns, chats * turns, 0)
    w = res["workload"]
    assert (w["name"], w["conversations"], w["turns"], w["turn_len"], w["first_len"]) == (
        "multi-turn", chats, turns, turn_len, first)  # fmt: skip
    assert (w["ttft_ms"]["cold"]["requests"], w["ttft_ms"]["reused"]["requests"]) == (3, 6)
    assert res["config"]["concurrency"] == chats  # every chat may have a turn in flight
    _check_latencies(res)

    tok = load_tokenizer("dummy:tiny")
    assert len(sent) == chats * turns
    for c in range(chats):
        mine = [(p, rec) for p, rec in sent if rec.tags["conversation"] == c]
        assert [rec.tags["turn"] for _, rec in mine] == list(range(turns))
        assert len(tok.encode(mine[0][0])) == first
        for (prev, prev_rec), (prompt, rec) in zip(mine, mine[1:]):
            assert rec.start >= prev_rec.end  # a turn waits for the answer before it
            assert prev_rec.text  # the answer, which the next turn resends
            history = prev + prev_rec.text
            assert prompt.startswith(history)
            h, ids = tok.encode(history), tok.encode(prompt)
            assert ids[: len(h)] == h and len(ids) == len(h) + turn_len
            assert rec.input_len == len(ids)
    for r in res["requests"]:
        assert r["prompt_tokens"] == r["input_len"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--documents", "3"], "--documents do(es) not apply to --workload random"),
        (["--workload", "multi-turn", "--question-len", "8"], "--question-len do(es) not apply"),
        (["--workload", "multi-turn", "--request-rate", "2"], "--request-rate does not apply"),
        (["--workload", "shared-prefix", "--num-requests", "5"], "--num-requests does not"),
        (["--workload", "shared-prefix", "--duration", "5"], "--duration does not apply"),
        (["--workload", "shared-prefix", "--documents", "0"], "--documents must be >= 1"),
        (["--workload", "shared-prefix", "--question-len", "-1"], "--question-len must be >= 0"),
    ],
)
def test_bench_serve_workload_flags_are_checked(flags, message, capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_bench_serve_counts_cached_tokens_when_the_server_reports_them():
    from flashserve.bench.client import RequestRecord, _openai_event
    from flashserve.bench.serve_stats import summarize

    recs = [RequestRecord(100, 2), RequestRecord(100, 2)]
    for rec, cached in zip(recs, (0, 96)):
        rec.start, rec.end = 0.0, 0.5
        for t, text in ((0.1, "a"), (0.2, "b")):
            _openai_event({"choices": [{"text": text, "finish_reason": None}]}, rec, t)
        usage = {"prompt_tokens": 100, "completion_tokens": 2,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        _openai_event({"choices": [], "usage": usage}, rec, 0.3)
        assert rec.text == "ab" and rec.cached_tokens == cached
    stats = summarize(recs, 1.0, 0)
    assert stats["summary"]["cached_tokens"] == 96
    assert [r["cached_tokens"] for r in stats["requests"]] == [0, 96]
    rec = RequestRecord(10, 1)
    _openai_event({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 1}}, rec, 0)
    assert summarize([rec], 1.0, 0)["summary"]["cached_tokens"] is None


def test_launch_table_groups_kernels_by_name_and_grid():
    from flashserve.bench.profiling import launch_table

    rng = random.Random()
    a = [rng.uniform(1, 20) for _ in range(4)]  # two steps of [768] launches, two a step
    b = [rng.uniform(21, 40) for _ in range(2)]  # one [3584] launch a step
    events = [{"cat": "kernel", "name": "_linear_kernel", "dur": d, "args": {"grid": [768, 1, 1]}}
              for d in a]  # fmt: skip
    events += [{"cat": "kernel", "name": "_linear_kernel", "dur": d, "args": {"grid": [3584, 1, 1]}}
               for d in b]  # fmt: skip
    events.append({"cat": "cpu_op", "name": "aten::mm", "dur": 99.0})  # not a kernel
    lines = launch_table({"traceEvents": events}, steps=2).splitlines()
    rows = {ln.split("]")[0].split("[")[1]: ln.split("]")[1].split() for ln in lines[1:]}
    assert set(rows) == {"768, 1, 1", "3584, 1, 1"}
    calls, mean, fastest, median, per_step, share = map(float, rows["768, 1, 1"])
    assert (calls, per_step) == (2.0, round(sum(a) / 2, 1))
    assert abs(mean - sum(a) / 4) < 0.01
    assert abs(fastest - min(a)) < 0.01
    assert abs(median - sorted(a)[1] / 2 - sorted(a)[2] / 2) < 0.01
    assert abs(share - 100 * sum(a) / (sum(a) + sum(b))) < 0.1
    first = lines[1].split("]")[0]  # most total time first
    assert first.endswith("768, 1, 1" if sum(a) > sum(b) else "3584, 1, 1")
