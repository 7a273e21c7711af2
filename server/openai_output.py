"""Engine outputs -> the pieces of OpenAI responses: streamed text, finish reasons, logprobs.

Streaming never shows a stop string: the engine cuts a stop string out of ``generated_text``
only once the string is complete, so text that could still become the start of one (the
engine counts it: ``RequestOutput.held_back``) is held back until the next token tells
(``Choice.delta``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from flashserve.engine.outputs import RequestOutput, TokenOutput
from server.openai_schemas import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)

_FINISH_REASONS = {"eos_token": "stop", "stop_sequence": "stop", "length": "length"}


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's finish reason ("stop" or "length") of a finished output; None before."""
    if not out.finished:
        return None
    return _FINISH_REASONS.get(out.finish_reason or "length", out.finish_reason)


@dataclass
class Choice:
    """One choice's progress through a stream: what of its text has been sent."""

    index: int
    sent: int = 0  # characters of generated_text already sent
    offset: int = 0  # text offset of the next token (completions' logprobs)

    def delta(self, out: RequestOutput) -> str:
        """The text ``out`` adds that is safe to send: all of it once finished, otherwise all
        but a tail that may start a stop string."""
        text = out.generated_text
        end = len(text) if out.finished else len(text) - out.held_back
        new = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return new


def visible(tokens: list[TokenOutput]) -> list[TokenOutput]:
    """The tokens whose text is in the output (special tokens like EOS are skipped there)."""
    return [t for t in tokens if not t.special]


def completion_logprobs(tokens: list[TokenOutput], choice: Choice) -> CompletionLogprobs:
    """The legacy completions shape; each top dict holds the top-N and the chosen token."""
    lp = CompletionLogprobs()
    for tok in visible(tokens):
        top = {text: value for _, text, value in tok.top_logprobs or []}
        top.setdefault(tok.text, tok.logprob)
        lp.tokens.append(tok.text)
        lp.token_logprobs.append(tok.logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(choice.offset)
        choice.offset += len(tok.text)
    return lp


def chat_logprobs(tokens: list[TokenOutput], top_n: int) -> ChatLogprobs:
    """The chat shape: each token with its bytes and its ``top_n`` best alternatives."""
    content = [
        TokenLogprob(
            token=tok.text,
            logprob=tok.logprob,
            bytes=list(tok.text.encode()),
            top_logprobs=[_top(text, value) for _, text, value in (tok.top_logprobs or [])][:top_n],
        )
        for tok in visible(tokens)
    ]
    return ChatLogprobs(content=content)


def _top(text: str, logprob: float) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))


async def merged(
    firsts: list[RequestOutput], streams: list[AsyncGenerator[RequestOutput, None]]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice, output) from concurrent requests as they come, given their first outputs;
    closing it early cancels and closes every request (which aborts them in the engine)."""
    for i, first in enumerate(firsts):
        yield i, first
    pending = {
        asyncio.ensure_future(anext(streams[i])): i for i, f in enumerate(firsts) if not f.finished
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        await close_all(streams, pending)


async def close_all(
    streams: list[AsyncGenerator[RequestOutput, None]], tasks: list | dict = ()
) -> None:
    """Cancel ``tasks`` (pending reads of ``streams``), then close every stream."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for stream in streams:
        await stream.aclose()
