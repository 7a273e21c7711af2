"""What the prompt tokenization cache saves (``flashserve.tokenizer.encode_cache``): a chat of
``--tokens`` tokens (one long user message, then short turns) through the default model's chat
template and tokenizer, tokenized whole against through the cache, turn by turn; and the same
prompt sent again.

    python3 docs/benchmarks/encode_cache_bench.py [--tokens 120000] [--turns 4] [--json FILE]

Every id list the cache returns is checked against the whole tokenization first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from flashserve.bench.prompts import make_prompt
from flashserve.loaders.load import default_model_path
from flashserve.tokenizer.encode_cache import EncodeCache
from flashserve.tokenizer.tokenizer import Tokenizer


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=120000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(default_model_path())
    rng = random.Random(0)
    messages = [{"role": "user", "content": make_prompt(args.tokens, rng, tok)}]
    cache = EncodeCache(tok)
    rows = []
    for turn in range(args.turns):
        text = tok.apply_chat_template(messages)
        whole_s, want = timed(tok.encode, text)
        cached_s, got = timed(cache, text)
        again_s, again = timed(cache, text)
        if got != want or again != want:
            print(f"turn {turn}: the cache's ids differ from the whole tokenization")
            return 1
        rows.append({"turn": turn, "tokens": len(want), "chars": len(text),
                     "whole_ms": whole_s * 1e3, "cache_ms": cached_s * 1e3,
                     "sent_again_ms": again_s * 1e3})  # fmt: skip
        print(f"turn {turn}: {len(want)} tokens, whole {whole_s * 1e3:.1f} ms, through the "
              f"cache {cached_s * 1e3:.1f} ms, sent again {again_s * 1e3:.2f} ms")  # fmt: skip
        messages += [{"role": "assistant", "content": make_prompt(200, rng, tok)},
                     {"role": "user", "content": make_prompt(100, rng, tok)}]  # fmt: skip
    later = rows[1:] or rows
    print(
        f"later turns: whole {statistics.median(r['whole_ms'] for r in later):.1f} ms, through "
        f"the cache {statistics.median(r['cache_ms'] for r in later):.1f} ms (medians)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "turns": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
