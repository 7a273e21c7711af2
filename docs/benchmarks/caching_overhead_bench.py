"""What prefix caching costs prompts that share nothing: random-prompt throughput, caching on
against off, over alternated pairs of servers.

Issue 16's target: "Random prompts (no reuse): throughput within 2% of caching off." One server
process against another reads up to a few percent apart for reasons of their own (2026-11-24:
a warm-up pair 3.2% apart, the warm pair 1.0%), so one pair cannot show a 2% bound. This script
starts ``--pairs`` pairs of servers (``python -m server serve``, this checkout), the order
alternating (on then off, off then on, ...), and on each runs an untimed warm-up and then
``--runs`` timed random workloads (``flashserve bench serve --api openai``, each with its own
seed, the same seeds on every server); it reports each pair's ratio (on / off requests/s, the
median of the server's timed runs) and the median and spread of the ratios.

    python docs/benchmarks/caching_overhead_bench.py --pairs 3 --runs 2 \
        --server-args "--model dummy:llama3.1-8b" [--json FILE]

Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from server_utils import server_process  # noqa: E402

SERVERS = {"on": (), "off": ("--no-prefix-caching",)}


def workload(url: str, args: argparse.Namespace, seed: int, requests: int) -> dict:
    """One ``bench serve`` run against ``url``: its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "flashserve", "bench", "serve", "--url", url, "--api",
               "openai", "--no-progress", "--num-requests", str(requests), "--concurrency",
               str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--seed", str(seed), "--json", str(out)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def server_runs(label: str, args: argparse.Namespace) -> list[float]:
    """Requests/s of the timed runs on one fresh server (caching ``label``)."""
    flags = (*SERVERS[label], *shlex.split(args.server_args))
    with server_process(*flags, timeout=args.ready_timeout) as url:
        workload(url, args, seed=1000, requests=args.warmup)
        rates = []
        for k in range(args.runs):
            res = workload(url, args, seed=k, requests=args.num_requests)
            summary = res["summary"]
            if summary["failed"]:
                raise RuntimeError(f"{summary['failed']} requests failed ({label}, run {k})")
            rates.append(summary["request_throughput"])
    print(f"  caching {label}: {', '.join(f'{r:.3f}' for r in rates)} requests/s", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--runs", type=int, default=2, help="timed runs per server")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=64, help="requests of the untimed run")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--server-args", default="", help="more `serve` options, one string")
    parser.add_argument("--ready-timeout", type=float, default=600, help="seconds to /health")
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    args = parser.parse_args()
    # the server processes import this checkout (ahead of whatever PYTHONPATH held)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    pairs = []
    for i in range(args.pairs):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        print(f"pair {i} ({' then '.join(order)})", flush=True)
        rates = {label: server_runs(label, args) for label in order}
        ratio = statistics.median(rates["on"]) / statistics.median(rates["off"])
        pairs.append({"order": order, "rates": rates, "ratio": ratio})
    ratios = [p["ratio"] for p in pairs]
    print("\n| pair | order | on (req/s) | off (req/s) | on / off |")
    print("|---|---|---|---|---|")
    for i, p in enumerate(pairs):
        on, off = (statistics.median(p["rates"][k]) for k in ("on", "off"))
        print(f"| {i} | {' then '.join(p['order'])} | {on:.3f} | {off:.3f} | {p['ratio']:.4f} |")
    print(f"\nmedian on / off {statistics.median(ratios):.4f} "
          f"(range {min(ratios):.4f} - {max(ratios):.4f})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "pairs": pairs}, indent=1))


if __name__ == "__main__":
    main()
