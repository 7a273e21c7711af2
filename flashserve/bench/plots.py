"""Plots of the benchmarks' JSON results (matplotlib, imported only here)."""

from __future__ import annotations

from typing import Any

from flashserve.bench.report import pyplot


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
    """Cumulative distributions of TTFT, inter-token latency and end-to-end latency."""
    plt = pyplot()
    samples = result["samples_ms"]
    keys = [("ttft", "time to first token"), ("itl", "inter-token latency"),
            ("e2e", "end-to-end latency")]  # fmt: skip
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 4))
    for ax, (key, title) in zip(axes, keys):
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
