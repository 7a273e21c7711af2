"""``flashserve bench serve``: an HTTP load generator for TGI or OpenAI completion servers.

Requests stream (SSE) so that every token is timed as the client sees it: time to first
token, inter-token latency, time per output token, end-to-end latency, throughput and
failures by HTTP status. Load is a fixed number of requests in flight (``--concurrency``)
or Poisson arrivals (``--request-rate``). ``--depth N`` measures decode at depth: prompts of
N tokens, then ``--output-len`` generated tokens. Requests go only to ``--url``, and the run
is bounded by ``--num-requests`` and ``--max-duration``; with ``--duration`` requests are sent
for that long instead of counted (soak runs). ``--sample-metrics`` records the server's memory
and load from its /metrics over the run (``flashserve/bench/server_metrics.py``).
``--workload shared-prefix`` and ``--workload multi-turn`` send prompts that reuse context
(``flashserve/bench/workloads.py``), to compare prefix caching on and off.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import random
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import flashserve
from flashserve.bench import workloads
from flashserve.bench.prompts import TokenizerLike, load_tokenizer, make_prompt, sample_lengths
from flashserve.bench.report import Counter, require_matplotlib, write_json
from flashserve.cli import args as cli

if TYPE_CHECKING:
    from flashserve.bench.client import RequestRecord
    from flashserve.bench.server_metrics import MetricsSampler


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument(
        "--api",
        choices=["tgi", "openai"],
        default="tgi",
        help="tgi: /generate_stream; openai: /v1/completions",
    )
    parser.add_argument("--model", help="the model field of OpenAI requests")
    parser.add_argument(
        "--tokenizer",
        help="model spec whose tokenizer sizes the prompts "
        "(default: the model /info names, when it can be loaded here)",
    )
    parser.add_argument("--num-requests", type=int, help="default 100 (1 with --depth)")
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="send requests for this long instead of --num-requests, then wait for those "
        "in flight (up to --max-duration from the start)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight (default 8, 1 with --depth; with "
        "--request-rate an upper bound, none by default)",
    )
    parser.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens (mean)")
    parser.add_argument(
        "--input-len-range",
        type=float,
        default=0.0,
        help="prompt lengths uniform in len*(1-r) .. len*(1+r)",
    )
    parser.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    parser.add_argument("--output-len-range", type=float, default=0.0)
    parser.add_argument("--depth", type=int, help="decode at depth: prompts of this many tokens")
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument(
        "--max-duration",
        type=float,
        default=3600.0,
        help="stop (cancelling requests in flight) after this many seconds",
    )
    parser.add_argument(
        "--sample-metrics",
        type=float,
        metavar="SECONDS",
        help="scrape the server's /metrics this often: memory and load over time, memory drift",
    )
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="plot latency CDFs")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    workloads.add_args(parser)


def run(args: argparse.Namespace) -> int:
    _defaults(args)
    if args.plot:
        require_matplotlib()
    if args.api == "openai" and args.model is None:
        args.model = _get_json(args.url, "/v1/models", lambda d: d["data"][0]["id"])
    tokenizer, tok_source = _tokenizer(args)
    launch = _launcher(args, tokenizer)  # prompts made before the clock starts
    records, duration, cancelled, sampler = asyncio.run(_load(args, launch))
    from flashserve.bench.serve_stats import format_report, summarize

    stats = summarize(records, duration, cancelled)
    workload = workloads.describe(args)
    if split := workloads.reuse_latency(stats["requests"]):
        workload["ttft_ms"] = split
    result = {
        "config": {k: v for k, v in vars(args).items() if k != "run"},
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flashserve": flashserve.__version__,
            "server_info": _get_json(args.url, "/info", lambda d: d),  # TGI's /info
        },
        "tokenizer": tok_source,
        "workload": workload,
        **stats,
    }
    if sampler is not None:
        result["server_metrics"] = sampler.result(duration)
    print(format_report(result))
    if args.json:
        write_json(args.json, result)
    if args.plot:
        from flashserve.bench.plots import plot_serve

        plot_serve(result, args.plot)
    return 0


def _defaults(args: argparse.Namespace) -> None:
    workloads.check(args)
    depth = args.depth is not None
    if depth:
        args.input_len, args.input_len_range = args.depth, 0.0
    if args.duration is not None and args.num_requests is not None:
        raise cli.CLIError("give --duration or --num-requests, not both", status=2)
    if args.num_requests is None and args.duration is None:
        args.num_requests = 1 if depth else 100
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 1 if depth else 8
    checks = [
        (args.num_requests is None or args.num_requests >= 1, "--num-requests must be >= 1"),
        (args.duration is None or 0 < args.duration < args.max_duration,
         "--duration must be > 0 and shorter than --max-duration"),
        (args.sample_metrics is None or args.sample_metrics > 0, "--sample-metrics must be > 0"),
        (args.concurrency is None or args.concurrency >= 1, "--concurrency must be >= 1"),
        (args.request_rate is None or args.request_rate > 0, "--request-rate must be > 0"),
        (args.input_len >= 1 and args.output_len >= 1, "lengths must be >= 1"),
        (0 <= args.input_len_range < 1 and 0 <= args.output_len_range < 1,
         "length ranges must be in [0, 1)"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise cli.CLIError(message, status=2)


def _tokenizer(args: argparse.Namespace) -> tuple[TokenizerLike | None, str]:
    """The tokenizer that sizes prompts, and where it came from (for the record)."""
    spec = args.tokenizer or _get_json(args.url, "/info", lambda d: d["model_id"]) or args.model
    if spec is None:
        return None, "none: about 1.3 tokens per word"
    try:
        return load_tokenizer(spec), spec
    except (OSError, ValueError) as exc:
        if args.tokenizer is not None:
            raise cli.CLIError(f"cannot load the tokenizer {spec!r}: {exc}") from exc
        print(f"no tokenizer for {spec!r}; prompt lengths are estimated", file=sys.stderr)
        return None, "none: about 1.3 tokens per word"


def _get_json(url: str, route: str, pick) -> str | None:
    """``pick(JSON of GET url+route)``, or None when the server does not answer that."""
    import httpx

    try:
        resp = httpx.get(url.rstrip("/") + route, timeout=10)
        return pick(resp.json()) if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, LookupError, TypeError):
        return None


Launch = Callable[[Callable[..., Awaitable[Any]], float], Awaitable[list[asyncio.Task]]]


def _launcher(args: argparse.Namespace, tokenizer: TokenizerLike | None) -> Launch:
    """``launch(one, stop)``: starts the workload's requests, each through ``one(prompt,
    record)``, until they or the time (``stop``) run out; returns the tasks started."""
    if args.workload == "multi-turn":
        starts = workloads.conversation_starts(args, tokenizer)
        return lambda one, stop: workloads.launch_conversations(args, tokenizer, starts, one, stop)
    if args.workload == "shared-prefix":
        specs: Iterable[tuple[str, RequestRecord]] = workloads.shared_prefix_specs(args, tokenizer)
    else:
        specs = _request_specs(args, tokenizer)
        if args.duration is None:
            specs = list(specs)
    return lambda one, stop: _launch(args, specs, one, stop)


def _request_specs(args, tokenizer) -> Iterator[tuple[str, RequestRecord]]:
    """(prompt, record) of each request: --num-requests of them, or no end with --duration
    (drawn 256 at a time)."""
    from flashserve.bench.client import RequestRecord

    rng = random.Random(args.seed)
    n = args.num_requests or 256
    while True:
        ins = sample_lengths(args.input_len, args.input_len_range, n, rng)
        outs = sample_lengths(args.output_len, args.output_len_range, n, rng)
        for i, o in zip(ins, outs):
            yield make_prompt(i, rng, tokenizer), RequestRecord(i, o)
        if args.num_requests is not None:
            return


async def _load(
    args, launch: Launch
) -> tuple[list[RequestRecord], float, int, MetricsSampler | None]:
    """Send the requests (paced by the arrival process, or a chat's turns) until they or
    --duration run out, and wait for those in flight; (finished records in the order sent,
    seconds taken, requests cancelled or never sent when --max-duration ran out, the /metrics
    sampler if any)."""
    import httpx

    from flashserve.bench.client import send
    from flashserve.bench.server_metrics import MetricsSampler

    limit = args.concurrency  # None: no bound (Poisson arrivals)
    sem = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()
    counter = Counter(args.num_requests, "requests", not args.no_progress)
    timeout = httpx.Timeout(args.timeout, connect=min(30.0, args.timeout))
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    sampler = MetricsSampler(args.url, args.sample_metrics) if args.sample_metrics else None

    finished: list[RequestRecord] = []  # a task may send several (a chat's turns)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def one(prompt: str, rec: RequestRecord) -> RequestRecord:
            async with sem:
                await send(client, args.url, args.api, prompt, rec, args.model)
            finished.append(rec)
            counter.update()
            return rec

        start = time.perf_counter()
        if sampler is not None:
            sampler.start(start)
        tasks = await launch(one, start + (args.duration or args.max_duration))
        left = max(0.0, start + args.max_duration - time.perf_counter())
        _, pending = await asyncio.wait(tasks, timeout=left) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    counter.close()
    if sampler is not None:
        await sampler.stop()
    records = sorted(finished, key=lambda r: r.start)
    return records, duration, (args.num_requests or len(tasks)) - len(records), sampler


async def _launch(args, specs, one, stop: float) -> list[asyncio.Task]:
    """Start requests until ``specs`` or the time (``stop``) run out: whenever fewer than
    --concurrency are in flight, or at Poisson arrival times."""
    rng = random.Random(args.seed + 1)
    tasks: list[asyncio.Task[Any]] = []
    in_flight: set[asyncio.Task[Any]] = set()
    arrival = time.perf_counter()
    for prompt, rec in specs:
        if args.request_rate is not None:
            if tasks:  # absolute times: the time spent making prompts does not slow the rate
                arrival += rng.expovariate(args.request_rate)
            await asyncio.sleep(min(arrival, stop) - time.perf_counter())
        elif len(in_flight) >= args.concurrency:
            _, in_flight = await asyncio.wait(
                in_flight, timeout=stop - time.perf_counter(), return_when=asyncio.FIRST_COMPLETED
            )
        if time.perf_counter() >= stop:
            break
        task = asyncio.create_task(one(prompt, rec))
        tasks.append(task)
        in_flight.add(task)  # pruned by the wait above (fixed concurrency only)
    return tasks


SERVE = cli.Command("serve", "load an HTTP server (TGI or OpenAI API), streaming", add_args, run)
