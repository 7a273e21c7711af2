"""The ``flashserve`` command line: the engine's arguments and the ``generate`` command.

The HTTP server adds its ``serve`` command through ``extra_commands`` (``server/cli.py`` holds
the console script), so that this package never imports the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import flashserve
from flashserve.config import ATTENTION_BACKENDS, EngineConfig
from flashserve.sampling_params import SamplingParams
from flashserve.text_checks import lone_surrogate

if TYPE_CHECKING:
    from flashserve.llm_engine import LLM

T = TypeVar("T")


class Command(NamedTuple):
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class CLIError(Exception):
    """A message for the user and the exit status: 2 for bad arguments, 1 for a failure."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig fields as options; defaults (None) leave EngineConfig's own."""
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        help="a Hugging Face directory, a .gguf file or dummy:<preset> "
        "(default: the embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--device", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument(
        "--dtype",
        help="auto (default: bfloat16 on CUDA, float32 on CPU), float32, float16 or bfloat16",
    )
    g.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, help="sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, help="token budget of one step")
    g.add_argument(
        "--max-kv-tokens",
        type=int,
        help="KV cache size in tokens (default: from --gpu-memory-utilization)",
    )
    g.add_argument("--gpu-memory-utilization", type=float, help="share of GPU memory to use")
    g.add_argument("--block-size", type=int, help="tokens per KV cache block (a power of two)")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS)
    g.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each decode step on the device before the host has read the one "
        "before it, hiding the host's work between steps (steps with penalties or logprobs "
        "run plainly); default: on with CUDA",
    )


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    given = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    try:
        return EngineConfig(**given)
    except ValueError as exc:
        raise CLIError(str(exc), status=2) from exc


def load_engine(factory: Callable[[EngineConfig], T], config: EngineConfig) -> T:
    """Build an engine (``LLM``, ``AsyncLLM``); a model that cannot be loaded is a CLIError."""
    try:
        return factory(config)
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot load the model {config.model or '(default)'}: {exc}") from exc


# ---- generate ------------------------------------------------------------------------------


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
    from flashserve.llm_engine import LLM  # the model stack loads only when it is needed

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


# ---- entry point ---------------------------------------------------------------------------


def build_parser(extra_commands: Sequence[Command] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashserve", description=flashserve.__doc__)
    parser.add_argument("--version", action="version", version=flashserve.__version__)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    from flashserve.bench import BENCH  # here: flashserve.bench imports this module

    for cmd in (*extra_commands, GENERATE, BENCH):
        sub = subparsers.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_args(sub)
        sub.set_defaults(run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None, extra_commands: Sequence[Command] = ()) -> int:
    args = build_parser(extra_commands).parse_args(argv)
    try:
        return args.run(args)
    except CLIError as exc:
        print(f"flashserve {args.command}: error: {exc}", file=sys.stderr)
        return exc.status
    except KeyboardInterrupt:
        return 130
