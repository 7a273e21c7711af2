"""Time to first token of a prompt whose long prefix is already in the prefix cache, in
process, and where that time goes.

    python3 docs/benchmarks/reuse_ttft.py --model dummy:llama3.1-8b --prefix 120000 \
        --new 64 --rounds 3 [--profile DIR] [any engine option, e.g. --kv-cache-dtype fp8]

One engine (prefix caching on). A prompt of ``--prefix`` random tokens is prefilled once
(untimed: the cold request), then each round sends that prefix plus ``--new`` fresh tokens
and times, from handing the engine the request to its first token: the request's making
(tokenization checks, the detokenizer), and the engine's steps (the prefix-cache lookup, the
prefill of the tokens not found, the first token). ``--profile DIR`` runs one more such request
under the torch profiler (``flashserve.bench.profiling``: the GPU kernels by name and grid).
The same split of ``--prefix + --new`` tokens prefilled cold is timed beside it for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from flashserve.bench.hardware import synchronize
from flashserve.bench.profiling import profile_run
from flashserve.cli import args as cli
from flashserve.engine.llm_engine import LLMEngine
from flashserve.sampling.params import SamplingParams


def first_token(engine, ids: list[int]) -> dict[str, float]:
    """Seconds to make the request and to its first token; the tokens found in the cache."""
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    synchronize(torch.device(engine.config.device))
    start = time.perf_counter()
    req = engine.make_request(ids, params)
    made = time.perf_counter()
    engine.add(req)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    end = time.perf_counter()
    return {"make_s": made - start, "steps_s": end - made, "total_s": end - start,
            "steps": steps, "cached_tokens": req.seq.num_cached_tokens}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=120000)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", metavar="DIR")
    parser.add_argument("--json", metavar="FILE")
    cli.add_engine_args(parser)
    args = parser.parse_args()
    config = cli.engine_config_from_args(args)
    if args.max_model_len is None:
        config.max_model_len = args.prefix + args.new + 1
    engine = cli.load_engine(LLMEngine, config)
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size

    def fresh(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    prefix = fresh(args.prefix)
    cold = first_token(engine, prefix)  # the prefix into the cache (and first-use costs)
    reused = [first_token(engine, prefix + fresh(args.new)) for _ in range(args.rounds)]
    fresh_cold = first_token(engine, fresh(args.prefix + args.new))
    result = {"prefix": args.prefix, "new": args.new, "config": {k: str(v) for k, v in
              vars(config).items()}, "cold": cold, "reused": reused,
              "cold_fresh": fresh_cold}  # fmt: skip
    if args.profile:
        ids = prefix + fresh(args.new)
        result["profile"] = profile_run(lambda: first_token(engine, ids),
                                        torch.device(config.device), args.profile,
                                        "reused-prefill", 1, "prefill", "prefill")  # fmt: skip
    med = statistics.median(r["total_s"] for r in reused)
    print(f"cold {cold['total_s']:.3f} s ({args.prefix} tokens); fresh "
          f"{fresh_cold['total_s']:.3f} s ({args.prefix + args.new}); reused: median "
          f"{med * 1e3:.1f} ms, rounds " + ", ".join(
              f"{r['total_s'] * 1e3:.1f} ms (make {r['make_s'] * 1e3:.1f}, {r['steps']} steps, "
              f"{r['cached_tokens']} cached)" for r in reused))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
