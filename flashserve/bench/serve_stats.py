"""Summaries of ``bench serve`` runs: latency percentiles, throughput, failures, and the
server's memory and load when they were sampled."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from flashserve.bench.client import RequestRecord
from flashserve.bench.report import percentiles, table
from flashserve.bench.server_metrics import MIB


def per_request(rec: RequestRecord) -> dict[str, Any]:
    """One request's record with its latencies in ms (None where it has no tokens)."""
    t = rec.token_times
    ttft = (t[0] - rec.start) * 1e3 if t else None
    # a server may send several tokens in one event (held-back UTF-8 bytes): count tokens
    n = max(rec.output_tokens, len(t))
    decode_s = t[-1] - t[0] if len(t) > 1 else None
    return {
        "status": rec.status,
        "error": rec.error,
        "input_len": rec.input_len,
        "output_len": rec.output_len,
        "prompt_tokens": rec.prompt_tokens,
        "output_tokens": rec.output_tokens,
        "token_events": len(t),
        "finish_reason": rec.finish_reason,
        "cached_tokens": rec.cached_tokens,
        "tags": rec.tags,
        "ttft_ms": ttft,
        "tpot_ms": decode_s / (n - 1) * 1e3 if decode_s else None,
        "e2e_ms": (rec.end - rec.start) * 1e3,
        "decode_tokens_per_s": (n - 1) / decode_s if decode_s else None,
        "itl_ms": [(b - a) * 1e3 for a, b in zip(t, t[1:])],
    }


def _dist(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values) if values else float("nan")
    return {**percentiles(values), "mean": mean}


def summarize(records: list[RequestRecord], duration_s: float, cancelled: int) -> dict[str, Any]:
    """Totals, throughput and latency distributions over the finished requests."""
    reqs = [per_request(r) for r in records]
    good = [r for r in reqs if r["status"] == "ok"]
    pick = lambda key: [r[key] for r in good if r[key] is not None]
    out_tokens = sum(r["output_tokens"] for r in good)
    in_tokens = sum(r["prompt_tokens"] or r["input_len"] for r in good)
    summary = {
        "requests": len(records) + cancelled,
        "completed": len(good),
        "failed": len(reqs) - len(good),
        "cancelled": cancelled,  # still running when --max-duration ran out
        "failures": dict(Counter(r["status"] for r in reqs if r["status"] != "ok")),
        "all_completed": len(good) == len(records) + cancelled,  # no failure, none cut short
        "early_stops": sum(r["finish_reason"] not in (None, "length") for r in good),
        "duration_s": duration_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        # prompt tokens served from the server's prefix cache; None: the server does not say
        "cached_tokens": _total(r["cached_tokens"] for r in good),
        "request_throughput": len(good) / duration_s,
        "output_token_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
    }
    itl = [x for r in good for x in r["itl_ms"]]
    latency = {"ttft": pick("ttft_ms"), "itl": itl, "tpot": pick("tpot_ms"), "e2e": pick("e2e_ms")}
    return {
        "summary": summary,
        "latency_ms": {k: _dist(v) for k, v in latency.items()},
        "decode_tokens_per_s": _dist(pick("decode_tokens_per_s")),
        "samples_ms": {"ttft": latency["ttft"], "itl": itl, "e2e": latency["e2e"]},
        "requests": reqs,
    }


def _total(values) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def format_report(result: dict[str, Any]) -> str:
    s, lat = result["summary"], result["latency_ms"]
    names = {"ttft": "time to first token (ms)", "itl": "inter-token latency (ms)",
             "tpot": "time per output token (ms)", "e2e": "end-to-end latency (ms)"}  # fmt: skip
    rows = [[names[k], d["p50"], d["p90"], d["p99"], d["mean"]] for k, d in lat.items()]
    d = result["decode_tokens_per_s"]
    rows.append(["decode tokens/s per request", d["p50"], d["p90"], d["p99"], d["mean"]])
    failures = ", ".join(f"{k}: {v}" for k, v in s["failures"].items()) or "none"
    if s["all_completed"]:
        verdict = f"ALL {s['requests']} REQUESTS COMPLETED: no failure"
    else:
        verdict = (
            f"NOT ALL COMPLETED: {s['failed']} failed ({failures}), {s['cancelled']} cancelled"
        )
    lines = [
        table(["", "p50", "p90", "p99", "mean"], rows),
        f"requests: {s['completed']} completed, {s['failed']} failed ({failures}), "
        f"{s['cancelled']} cancelled, {s['early_stops']} stopped before their output length",
        f"duration {s['duration_s']:.2f} s: {s['request_throughput']:.2f} requests/s, "
        f"{s['output_token_throughput']:.1f} output tokens/s, "
        f"{s['total_token_throughput']:.1f} total tokens/s",
    ]
    if s["cached_tokens"] is not None:
        share = s["cached_tokens"] / max(1, s["input_tokens"])
        lines.append(f"prompt tokens from the server's cache: {s['cached_tokens']} ({share:.1%})")
    if "workload" in result:
        from flashserve.bench.workloads import format_workload

        lines = [*format_workload(result["workload"]), *lines]
    if "server_metrics" in result:
        lines += _server_lines(result["server_metrics"])
    return "\n".join([*lines, verdict])


def _server_lines(m: dict[str, Any]) -> list[str]:
    """The sampled memory (MiB) and load of the server, or why there is none."""
    lines = [f"server /metrics: {m['scrapes'] - m['failed_scrapes']} of {m['scrapes']} "
             f"scrapes read, every {m['period_s']:g} s"]  # fmt: skip
    if m["failed_scrapes"]:
        lines[0] += f" (last error: {m['error']})"
    names = {"resident_memory_bytes": "resident memory", "gpu_allocated_bytes": "GPU allocated",
             "gpu_reserved_bytes": "GPU reserved"}  # fmt: skip
    rows = [[names[k], d["first"] / MIB, d["warm"] / MIB, d["last"] / MIB, d["max"] / MIB,
             d["drift_mib"], d["drift_percent"]] for k, d in m["memory"].items()]  # fmt: skip
    if rows:
        heads = ["memory (MiB)", "first", "after warm-up", "last", "max", "drift", "drift %"]
        lines.append(table(heads, rows))
    elif m["scrapes"] > m["failed_scrapes"]:
        lines.append("no memory series in the server's /metrics")
    load = ", ".join(f"{k} mean {d['mean']:.3g} max {d['max']:.3g}" for k, d in m["load"].items())
    if load:
        lines.append(f"server load: {load}")
    return lines
