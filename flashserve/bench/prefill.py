"""``flashserve bench prefill``: time to first token of one prompt, in process.

For each prompt length the engine prefills one prompt of random token ids and samples its
first token (``max_new_tokens=1``): the time from handing it the request to that token is the
time to first token (TTFT), chunked prefill under ``--max-num-batched-tokens`` included; the
model's FLOPs for the prompt (``prefill_flops``) over it give its TFLOP/s. The
peer, Hugging Face transformers (SDPA attention) on our very weights, runs one forward of the
same ids (logits of the last token only, a fresh KV cache, as ``generate`` prefills) and picks
the greedy token. Rounds alternate ours and the peer, each round with fresh ids (no cache can
help either side); one untimed round at the smallest length comes first. The table gives the
medians. On a GPU (``--device cuda``) the same command measures long prompts (32K, 128K);
``--profile DIR`` then shows where the time goes (attention, the linear layers, the rest:
``flashserve.bench.profiling``).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch

from flashserve.bench.decode import parse_sizes
from flashserve.bench.hardware import peak_memory, reset_peak_memory, synchronize
from flashserve.bench.profiling import profile_run
from flashserve.bench.report import progress, publish, run_metadata, table
from flashserve.cli import args as cli
from flashserve.sampling.params import SamplingParams

DEFAULT_TOKENS = "600,1800,6000"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokens",
        type=parse_sizes,
        default=parse_sizes(DEFAULT_TOKENS),
        help=f"prompt lengths in tokens (default {DEFAULT_TOKENS}; 32k or 128K work too)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per length (default 3)")
    parser.add_argument("--no-peer", action="store_true", help="skip Hugging Face transformers")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="after each length's timed rounds, prefill once more under the torch profiler: "
        "a Chrome trace, the busiest ops and the GPU kernels by name and grid in DIR",
    )
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cli.add_engine_args(parser)


def run(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise cli.CLIError("--rounds must be >= 1", status=2)
    from flashserve.engine.llm_engine import LLMEngine  # the model stack loads when the bench runs

    config = _engine_config(args)
    engine = cli.load_engine(LLMEngine, config)
    peer, peer_info = _make_peer(engine, args.no_peer)
    points = _measure(engine, peer, args)
    result = {
        "meta": {
            **run_metadata(),
            "model": engine.model_name,
            "device": config.device,
            "dtype": config.dtype,
            "attention_backend": config.attention_backend,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "block_size": config.block_size,
            "prefill_path": config.prefill_path,
            "threads": torch.get_num_threads(),
            "cpu_model": cpu_model(),
            "rounds": args.rounds,
            **peer_info,
        },
        "points": points,
    }
    publish(result, format_table(points), args.json)
    return 0


def _engine_config(args: argparse.Namespace):
    """The engine's config, with a context and a KV pool just long enough for the longest
    prompt and its one new token unless given: on a GPU the rest of the memory stays free
    for the peer."""
    config = cli.engine_config_from_args(args)
    need = max(args.tokens) + 1
    if args.max_model_len is None:
        config.max_model_len = need
    if not config.kv_pool_size_given:
        config.max_kv_tokens = -(-need // config.block_size) * config.block_size
    return config


def _make_peer(engine, no_peer: bool):
    """(transformers on our weights or None, the peer's description for the record)."""
    info: dict[str, Any] = {"peer": None, "peer_note": None}
    if no_peer:
        info["peer_note"] = "--no-peer"
        return None, info
    try:
        import transformers

        from flashserve.bench.decode_peer import PeerUnavailable, hf_model_sharing
    except ImportError:
        info["peer_note"] = "transformers is not installed"
        return None, info
    try:
        model = hf_model_sharing(engine.runner.model, engine.model_config, engine.max_model_len)
    except PeerUnavailable as exc:
        info["peer_note"] = str(exc)
        return None, info
    info["peer"] = f"transformers {transformers.__version__}, sdpa, one forward"
    return model, info


def _measure(engine, peer, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every length's point: warm-up first, then alternated rounds of ours and the peer."""
    gen = torch.Generator().manual_seed(engine.config.seed)
    device = torch.device(engine.config.device)
    fits = [n for n in args.tokens if n + 1 <= engine.max_model_len]
    if fits:  # first-use costs (allocator, kernels, thread pools), untimed
        ids = _random_ids(engine, min(fits), gen)
        time_ours(engine, ids)
        if peer is not None:
            time_peer(peer, ids, device)
    points = []
    for n in progress(args.tokens, "prefill", not args.no_progress):
        point: dict[str, Any] = {"tokens": n, "status": "ok", "note": None}
        point.update(ours=None, peer=None, peer_note=None, ratio=None)
        if n not in fits:
            point.update(status="skipped", note=f"over max model len {engine.max_model_len}")
        else:
            _measure_point(engine, peer, point, args.rounds, gen, device)
            if args.profile:
                ids = _random_ids(engine, n, gen)
                point["profile"] = profile_run(lambda ids=ids: time_ours(engine, ids), device,
                                               args.profile, f"prefill-{n}", 1, "prefill",
                                               "prefill")  # fmt: skip
        points.append(point)
    return points


def _measure_point(engine, peer, point: dict, rounds: int, gen, device: torch.device) -> None:
    """Fill ``point`` (in place) with ``rounds`` alternated timings of both sides."""
    n, ours, theirs = point["tokens"], [], []
    reset_peak_memory(device)
    for _ in range(rounds):
        ids = _random_ids(engine, n, gen)
        ours.append(time_ours(engine, ids))
        if peer is not None and point["peer_note"] is None:
            try:
                theirs.append(time_peer(peer, ids, device))
            except torch.cuda.OutOfMemoryError:
                point["peer_note"] = "out of memory"
                torch.cuda.empty_cache()
    flops = prefill_flops(engine.model_config, n)
    point["flops"] = flops
    point["ours"] = _summary(n, ours, flops["total"])
    if theirs and point["peer_note"] is None:
        point["peer"] = _summary(n, theirs, flops["total"])
        point["ratio"] = point["ours"]["median_s"] / point["peer"]["median_s"]
    point["peak_memory_bytes"], point["memory_kind"] = peak_memory(device)


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it (Linux), else the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _random_ids(engine, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist()


def time_ours(engine, ids: list[int]) -> float:
    """Seconds from handing the engine a request for ``ids`` to its first (only) token."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    device = torch.device(engine.config.device)
    synchronize(device)
    start = time.perf_counter()
    req = engine.make_request(ids, params)
    engine.add(req)
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - start
    if req.seq.num_output_tokens != 1:
        raise RuntimeError(f"the engine returned {req.seq.num_output_tokens} tokens, not 1")
    return elapsed


@torch.inference_mode()
def time_peer(model, ids: list[int], device: torch.device) -> float:
    """Seconds for transformers' forward of ``ids`` and the greedy pick of the next token."""
    x = torch.tensor([ids], device=device)
    synchronize(device)
    start = time.perf_counter()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    out.logits[0, -1].argmax().item()  # waits for the device, as our side reads its token
    return time.perf_counter() - start


def prefill_flops(config, tokens: int) -> dict[str, float]:
    """FLOPs of prefilling one prompt of ``tokens`` tokens (a ``ModelConfig``'s shape), as the
    issues count them: 2 per multiply-add; the projections of every token, the LM head for the
    last one; attention over the keys each query sees (causal, each layer's window), QK^T and
    P.V: ``4 * Hq * D`` per (query, key) pair. Llama-3-8B at 32,768 tokens: 4.57e14 + 2.81e14,
    7.39e14 in all (1.44 s is 513 TFLOP/s)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    per_token = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h  # one layer's weights
    linear = 2.0 * tokens * per_token * config.num_hidden_layers + 2.0 * h * config.vocab_size
    pairs = sum(_pairs(tokens, w) for w in config.layer_windows)
    attention = 4.0 * config.num_attention_heads * config.head_dim * pairs
    return {"linear": linear, "attention": attention, "total": linear + attention}


def _pairs(n: int, window: int) -> int:
    """(query, key) pairs of causal attention over ``n`` tokens, each query seeing its last
    ``window`` keys (0: all)."""
    if window <= 0 or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def _summary(tokens: int, times: list[float], flops: float) -> dict[str, Any]:
    median = statistics.median(times)
    return {"median_s": median, "times_s": times, "tokens_per_s": tokens / median,
            "tflops": flops / median / 1e12}  # fmt: skip


HEADERS = ["tokens", "ours s", "transformers s", "ratio (ours/tf)", "ours tok/s", "tf tok/s",
           "ours TFLOP/s", "attention share"]  # fmt: skip


def format_table(points: list[dict[str, Any]]) -> str:
    rows, notes = [], []
    for p in points:
        if p["status"] != "ok":
            rows.append([p["tokens"], "skipped"] + [None] * 6)
            notes.append(f"{p['tokens']} tokens: {p['note']}")
            continue
        if p["peer_note"]:
            notes.append(f"{p['tokens']} tokens, peer: {p['peer_note']}")
        o, q = p["ours"], p["peer"] or {}
        share = p["flops"]["attention"] / p["flops"]["total"]
        rows.append([p["tokens"], o["median_s"], q.get("median_s"), p["ratio"],
                     o["tokens_per_s"], q.get("tokens_per_s"), o["tflops"], share])  # fmt: skip
    return "\n".join([table(HEADERS, rows), *notes])


PREFILL = cli.Command("prefill", "time to first token of one prompt, beside transformers",
                      add_args, run)  # fmt: skip
