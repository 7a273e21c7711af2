"""Host cost per generated token of the engine's text work: incremental detokenizing, the
special-token check, and stop-string matching (what ``LLMEngine._append`` does per token besides
appending the id), on the default model's tokenizer (SmolLM2, 49K byte-level BPE).

    python docs/benchmarks/detok_bench.py [--tokens 4000]

Results: docs/benchmarks/ipc.md ("Where detokenizing runs"). Not a test.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's flashserve

TEXT = (
    "The engine core owns the scheduler, the KV cache, the model runner and the sampler. "
    "Requests, outputs and aborts cross between the processes; Grüße, 東京, and 🙂 too. "
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    import gguf

    from flashserve.engine.stop_strings import StopMatcher
    from flashserve.loaders.gguf import read_metadata
    from flashserve.loaders.load import default_model_path
    from flashserve.tokenizer.detokenizer import IncrementalDetokenizer
    from flashserve.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(read_metadata(gguf.GGUFReader(default_model_path())))
    ids = (tok.encode(TEXT * (args.tokens // 20)) * 2)[: args.tokens]
    print(f"{len(ids)} tokens of the default model's tokenizer")
    print("| work per token | mean (us) |")
    print("| --- | ---: |")
    for label, stops in (("detokenize + special check", []),
                         ("... + 2 stop strings", ["\n\nUser:", "###"]),
                         ("... + 16 stop strings of 100 chars", ["x" * 99 + str(i % 10)
                                                                 for i in range(16)])):  # fmt: skip
        detok, matcher = IncrementalDetokenizer(tok, ids[:8], True), StopMatcher(stops)
        t0 = time.perf_counter()
        for t in ids:
            delta = detok.add(t)
            if tok.is_special(t):
                tok.convert_ids_to_tokens([t])
            if stops:
                matcher.feed(delta)
        per = (time.perf_counter() - t0) / len(ids)
        print(f"| {label} | {per * 1e6:.1f} |")


if __name__ == "__main__":
    main()
