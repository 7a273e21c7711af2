"""Time to first token of a request whose long prefix an earlier request computed, over HTTP.

Issue 16's CPU target: "On the CPU, default model: a second request sharing a 3,000-token
prefix answers its first token in at most 20% of the first request's time." Each round sends
two streamed completions, one after the other: a fresh random prefix of ``--prefix`` token ids
plus a question of ``--suffix`` ids, then the same prefix with another question. The time to
first token is the time from sending the request to the first SSE chunk that carries a choice
(``max_tokens=1``: that chunk is the token). The script starts the server itself
(``python -m server serve``, this checkout), once with prefix caching on and once with
``--no-prefix-caching``, so that the second request's ratio can be compared with one flag.
One untimed short request warms each server up; medians over the rounds.

    python docs/benchmarks/prefix_cache_bench.py [--prefix 3000] [--rounds 5] [--json FILE]
        [--server-args "--model dummy:llama3.1-8b --max-model-len 140000"] [--caching on,off]

Results: docs/benchmarks/prefix-cache.md. Not a test: nothing here gates CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from server_utils import server_process, sse_events  # noqa: E402

# token ids away from the specials at the start of the default model's vocabulary (49,152)
LOW, HIGH = 1000, 40000


def ttft(client: httpx.Client, ids: list[int]) -> tuple[float, dict]:
    """(seconds to the first token, the usage chunk) of one streamed one-token completion."""
    body = {"prompt": ids, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first, usage = None, {}
    with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        for event in sse_events(x for x in r.iter_lines() if x != "data: [DONE]"):
            if event.get("choices") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                usage = event["usage"]
    assert first is not None, "no token came back"
    return first, usage


def run(url: str, prefixes: list[int], suffix: int, rounds: int, seed: int, warmup: int
        ) -> list[dict]:  # fmt: skip
    rng = random.Random(seed)
    rows = []
    with httpx.Client(base_url=url, timeout=600) as client:
        ttft(client, [rng.randrange(LOW, HIGH) for _ in range(warmup)])  # warm-up, untimed
        for prefix in prefixes:
            for k in range(rounds):
                shared = [rng.randrange(LOW, HIGH) for _ in range(prefix)]
                q1, q2 = ([rng.randrange(LOW, HIGH) for _ in range(suffix)] for _ in range(2))
                t1, u1 = ttft(client, shared + q1)
                t2, u2 = ttft(client, shared + q2)
                cached = [u.get("prompt_tokens_details", {}).get("cached_tokens")
                          for u in (u1, u2)]  # fmt: skip
                rows.append({"prefix": prefix, "round": k, "first_s": t1, "second_s": t2,
                             "ratio": t2 / t1, "prompt_tokens": u1.get("prompt_tokens"),
                             "cached_tokens": cached})  # fmt: skip
                print(f"  prefix {prefix} round {k}: first {t1:.3f} s, second {t2:.3f} s, "
                      f"ratio {t2 / t1:.3f}, cached {cached}", flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default="3000", help="shared prefix tokens (a,b,...: each)")
    parser.add_argument("--suffix", type=int, default=16, help="question tokens after it")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=8, help="tokens of the untimed request")
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    parser.add_argument("--server-args", default="", help="more `serve` options, one string")
    parser.add_argument("--caching", default="on,off", help="the servers to run: on, off or both")
    parser.add_argument("--ready-timeout", type=float, default=300, help="seconds to /health 200")
    args = parser.parse_args()
    prefixes = [int(x) for x in args.prefix.split(",")]
    # the server process imports this checkout (ahead of whatever PYTHONPATH held)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    results = {}
    servers = {"on": (), "off": ("--no-prefix-caching",)}
    for label in args.caching.split(","):
        flags = (*servers[label], *shlex.split(args.server_args))
        load = os.getloadavg()
        print(f"prefix caching {label} (load average {load[0]:.2f})", flush=True)
        with server_process(*flags, timeout=args.ready_timeout) as url:
            rows = run(url, prefixes, args.suffix, args.rounds, args.seed, args.warmup)
        for prefix in prefixes:
            mine = [r for r in rows if r["prefix"] == prefix]
            key = label if len(prefixes) == 1 else f"{label}-{prefix}"
            results[key] = {
                "prefix": prefix,
                "rows": mine,
                "load_before": load,
                "load_after": os.getloadavg(),
                "median_first_s": statistics.median(r["first_s"] for r in mine),
                "median_second_s": statistics.median(r["second_s"] for r in mine),
                "median_ratio": statistics.median(r["ratio"] for r in mine),
            }
    print("\n| caching | prefix | first request TTFT | second request TTFT | ratio (median) |")
    print("|---|---|---|---|---|")
    for label, res in results.items():
        print(f"| {label} | {res['prefix']} | {res['median_first_s']:.3f} s | "
              f"{res['median_second_s']:.3f} s | {res['median_ratio']:.3f} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
