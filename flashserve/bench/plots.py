"""Plots of the benchmarks' JSON results (matplotlib, imported only here)."""

from __future__ import annotations

from typing import Any

from flashserve.bench.report import pyplot
from flashserve.bench.server_metrics import MIB


def plot_decode(result: dict[str, Any], path: str) -> None:
    """Decode tokens/s per sequence against context, one panel per batch size: ours, the
    peer and the roofline."""
    plt = pyplot()
    points = [p for p in result["points"] if p["status"] == "ok"]
    batches = sorted({p["batch"] for p in points}) or [0]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, bsz in zip(axes[0], batches):
        pts = sorted((p for p in points if p["batch"] == bsz), key=lambda p: p["context"])
        ctx = [p["context"] for p in pts]
        series = [("flashserve", "ours", "-o"), ("transformers", "peer", "--s"),
                  ("roofline", "roofline", ":")]  # fmt: skip
        for label, key, style in series:
            xs = [c for c, p in zip(ctx, pts) if p.get(key)]
            ys = [p[key]["tokens_per_s_per_seq"] for p in pts if p.get(key)]
            if xs:
                ax.plot(xs, ys, style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens/s per sequence")
        ax.set_title(f"batch {bsz}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    meta = result["meta"]
    fig.suptitle(f"{meta['model']} on {meta['device_name']} ({meta['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_serve(result: dict[str, Any], path: str) -> None:
    """Cumulative distributions of TTFT, inter-token latency and end-to-end latency; below
    them the server's memory and load over time when they were sampled."""
    plt = pyplot()
    samples = result["samples_ms"]
    keys = [("ttft", "time to first token"), ("itl", "inter-token latency"),
            ("e2e", "end-to-end latency")]  # fmt: skip
    series = result.get("server_metrics", {}).get("samples")
    rows = 2 if series else 1
    fig, axes = plt.subplots(rows, len(keys), figsize=(15, 4 * rows), squeeze=False)
    if series:
        _plot_server_series(axes[1], series)
    for ax, (key, title) in zip(axes[0], keys):
        xs = sorted(samples[key])
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"{result['config']['url']} ({result['config']['api']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_server_series(axes, samples: list[dict[str, float]]) -> None:
    """Resident memory, GPU memory (MiB) and requests running / waiting against time."""
    panels = [("resident memory (MiB)", [("resident_memory_bytes", "resident")], MIB),
              ("GPU memory (MiB)", [("gpu_allocated_bytes", "allocated"),
                                    ("gpu_reserved_bytes", "reserved")], MIB),
              ("requests", [("running", "running"), ("waiting", "waiting")], 1)]  # fmt: skip
    for ax, (title, lines, unit) in zip(axes, panels):
        for key, label in lines:
            pts = [(s["t"], s[key] / unit) for s in samples if key in s]
            if pts:
                ax.plot(*zip(*pts), label=label)
        ax.set_xlabel("seconds since the start")
        ax.set_title(f"server: {title}")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend()
        else:
            ax.text(0.5, 0.5, "not in the server's /metrics", ha="center", transform=ax.transAxes)
