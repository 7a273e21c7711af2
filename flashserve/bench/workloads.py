"""``bench serve`` workloads that reuse context, to compare a server with prefix caching on and
off (``--prefix-caching`` / ``--no-prefix-caching``) with one flag.

- ``shared-prefix``: ``--documents K`` documents of ``--document-len N`` tokens and
  ``--questions Q`` questions of ``--question-len M`` tokens; question ``j`` is asked about
  document ``j mod K`` (prompt = document + question), so consecutive requests name different
  documents and a document's questions are spread over the run (a RAG service). With
  ``--question-len 0`` a question is its document alone: the same prompt sent again (a chat's
  "regenerate", a client's retry), whose prompt tokenization the server may skip too.
- ``multi-turn``: ``--conversations C`` chats of ``--turns T`` turns; the first prompt has
  ``--input-len`` tokens, every later one resends the previous prompt, the answer received
  and a new user message of ``--turn-len U`` tokens. A chat's turns go one after another; up
  to ``--concurrency`` requests (default C) are in flight over all chats.

Each request is tagged: ``cold`` when no request before it carried its context (a document's
first question, a chat's first turn), so the report gives time to first token of cold and
reused-context requests apart. Prompts are sized by ``prompts.extend_prompt``: a longer prompt
starts with exactly the tokens of the document or history it extends.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from flashserve.bench.prompts import TokenizerLike, extend_prompt, make_prompt, sample_lengths
from flashserve.bench.report import percentiles
from flashserve.cli import args as cli

if TYPE_CHECKING:  # the client imports httpx: not at every start of the command line
    from flashserve.bench.client import RequestRecord

WORKLOADS = ("random", "shared-prefix", "multi-turn")
# the target workload (8 documents of 16K tokens, 64 questions of 64 tokens)
SHARED = {"documents": 8, "document_len": 16384, "questions": 64, "question_len": 64}
CHAT = {"conversations": 8, "turns": 4, "turn_len": 128}

SendOne = Callable[[str, "RequestRecord"], Awaitable["RequestRecord"]]


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("workloads that reuse context")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="random",
        help="random: unrelated prompts; shared-prefix: questions about a few documents; "
        "multi-turn: chats that resend their history",
    )
    for name, default in SHARED.items():
        g.add_argument(
            f"--{name.replace('_', '-')}", type=int, help=f"shared-prefix (default {default})"
        )
    for name, default in CHAT.items():
        g.add_argument(
            f"--{name.replace('_', '-')}", type=int, help=f"multi-turn (default {default})"
        )


def check(args: argparse.Namespace) -> None:
    """Fill the workload's defaults; CLIError (status 2) for flags that do not go with it."""
    given = {k: getattr(args, k) for k in (*SHARED, *CHAT) if getattr(args, k) is not None}
    mine = (
        SHARED
        if args.workload == "shared-prefix"
        else CHAT
        if args.workload == "multi-turn"
        else {}
    )
    stray = [k for k in given if k not in mine]
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise cli.CLIError(f"{flags} do(es) not apply to --workload {args.workload}", status=2)
    if args.workload == "random":
        return
    clash = {"--num-requests": args.num_requests, "--duration": args.duration,
             "--depth": args.depth}  # fmt: skip
    if args.workload == "multi-turn":
        clash["--request-rate"] = args.request_rate  # a turn waits for the answer before it
    for flag, value in clash.items():
        if value is not None:
            raise cli.CLIError(f"{flag} does not apply to --workload {args.workload}", status=2)
    for name, default in mine.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
        least = 0 if name == "question_len" else 1  # 0: the document sent again as it is
        if getattr(args, name) < least:
            raise cli.CLIError(f"--{name.replace('_', '-')} must be >= {least}", status=2)
    if args.workload == "shared-prefix":
        args.num_requests = args.questions
    else:
        args.num_requests = args.conversations * args.turns
        if args.concurrency is None:
            args.concurrency = args.conversations  # every chat may have a turn in flight


def describe(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's parameters, for the JSON record."""
    out = {"output_len": args.output_len, "output_len_range": args.output_len_range}
    if args.workload == "random":
        return {"name": "random", "input_len": args.input_len,
                "input_len_range": args.input_len_range, **out}  # fmt: skip
    if args.workload == "shared-prefix":
        prompt = args.document_len + args.question_len
        return {"name": "shared-prefix", **{k: getattr(args, k) for k in SHARED},
                "prompt_len": prompt, **out}  # fmt: skip
    return {"name": "multi-turn", **{k: getattr(args, k) for k in CHAT},
            "first_len": args.input_len, **out}  # fmt: skip


def shared_prefix_specs(
    args: argparse.Namespace, tokenizer: TokenizerLike | None
) -> list[tuple[str, RequestRecord]]:
    """(prompt, record) of each question, in the order sent: documents interleaved."""
    from flashserve.bench.client import RequestRecord

    rng = random.Random(args.seed)
    docs = [make_prompt(args.document_len, rng, tokenizer) for _ in range(args.documents)]
    outs = sample_lengths(args.output_len, args.output_len_range, args.questions, rng)
    specs = []
    for j, out in enumerate(outs):
        d = j % args.documents
        if args.question_len:
            question, tokens = extend_prompt(docs[d], args.question_len, rng, tokenizer)
        else:  # the document again, as it is
            question, tokens = "", args.document_len
        tags = {"document": d, "question": j, "cold": j < args.documents}
        specs.append((docs[d] + question, RequestRecord(tokens, out, tags=tags)))
    return specs


def conversation_starts(
    args: argparse.Namespace, tokenizer: TokenizerLike | None
) -> list[tuple[random.Random, list[int], str]]:
    """Each chat's (random source, output lengths, first prompt), made before the clock starts."""
    starts = []
    for c in range(args.conversations):
        rng = random.Random(f"{args.seed}-chat-{c}")  # a chat's prompts do not depend on timing
        outs = sample_lengths(args.output_len, args.output_len_range, args.turns, rng)
        starts.append((rng, outs, make_prompt(args.input_len, rng, tokenizer)))
    return starts


async def launch_conversations(
    args: argparse.Namespace,
    tokenizer: TokenizerLike | None,
    starts: list[tuple[random.Random, list[int], str]],
    one: SendOne,
    stop: float,
) -> list[asyncio.Task[Any]]:
    """One task per chat, sending its turns one after another until they or the time
    (``stop``) run out; after a failed request the next turn resends the history without an
    answer."""
    from flashserve.bench.client import RequestRecord

    async def chat(c: int, rng: random.Random, outs: list[int], prompt: str) -> None:
        tokens, answer = args.input_len, None
        for t, out in enumerate(outs):
            if answer is not None:  # tokenizing a long history: off the event loop
                history = prompt + answer
                message, tokens = await asyncio.to_thread(
                    extend_prompt, history, args.turn_len, rng, tokenizer
                )
                prompt = history + message
            if time.perf_counter() >= stop:
                return
            rec = RequestRecord(tokens, out, tags={"conversation": c, "turn": t, "cold": t == 0})
            answer = (await one(prompt, rec)).text

    return [asyncio.create_task(chat(c, *start)) for c, start in enumerate(starts)]


def reuse_latency(requests: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Time to first token (ms) of the cold requests and of those whose context an earlier
    request carried, and how many of each; None for a workload without tags."""
    good = [r for r in requests if r["status"] == "ok" and r["ttft_ms"] is not None]
    if not any("cold" in r["tags"] for r in good):
        return None
    out = {}
    for name, cold in (("cold", True), ("reused", False)):
        ttft = [r["ttft_ms"] for r in good if r["tags"].get("cold") is cold]
        out[name] = {"requests": len(ttft), **percentiles(ttft)}
    return out


def format_workload(workload: dict[str, Any]) -> list[str]:
    """The workload's line, and cold against reused time to first token where it has them."""
    params = ", ".join(f"{k} {v}" for k, v in workload.items() if k not in ("name", "ttft_ms"))
    lines = [f"workload {workload['name']}: {params}"]
    split = workload.get("ttft_ms")
    if split:
        parts = [f"{k} ({d['requests']} requests) p50 {d['p50']:.1f} p90 {d['p90']:.1f}"
                 for k, d in split.items()]  # fmt: skip
        lines.append("time to first token (ms): " + "; ".join(parts))
    return lines
