"""``flashserve generate``: one prompt's text, printed as it comes."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from flashserve.cli.args import (
    CLIError,
    Command,
    add_engine_args,
    engine_config_from_args,
    load_engine,
)
from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.text_checks import lone_surrogate

if TYPE_CHECKING:
    from flashserve.engine.llm_engine import LLM


def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    # dest: EngineConfig has a seed of its own (dummy weights), which this is not
    parser.add_argument("--seed", dest="request_seed", type=int, help="makes sampling reproducible")
    add_engine_args(parser)


def _run_generate(args: argparse.Namespace) -> int:
    from flashserve.engine.llm_engine import LLM  # the model stack loads only when it is needed

    if why := lone_surrogate(args.prompt):  # argv bytes that are not UTF-8 arrive so
        raise CLIError(f"the prompt {why}", status=2)
    config = engine_config_from_args(args)
    params = _sampling_params(args)
    llm = load_engine(LLM, config)
    try:
        prompt = args.prompt
        if args.chat:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        _print_stream(llm, prompt, params)
    except ValueError as exc:  # no chat template; the prompt is empty or too long
        raise CLIError(str(exc)) from exc
    return 0


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.request_seed,
        )
    except ValueError as exc:
        raise CLIError(str(exc), status=2) from exc


def _print_stream(llm: LLM, prompt: str, params: SamplingParams) -> None:
    """The text on stdout as it comes, then a summary line on stderr."""
    start, printed, last = time.perf_counter(), 0, None
    for last in llm.stream(prompt, params):
        # the text so far rather than token texts: special tokens (EOS) are left out
        print(last.generated_text[printed:], end="", flush=True)
        printed = len(last.generated_text)
    print(flush=True)
    if last is not None:
        took = time.perf_counter() - start
        summary = f"{last.num_generated_tokens} tokens in {took:.2f} s"
        print(f"[{summary}, finish reason: {last.finish_reason}]", file=sys.stderr)


GENERATE = Command(
    "generate",
    "generate text for one prompt, printed as it comes",
    _add_generate_args,
    _run_generate,
)
