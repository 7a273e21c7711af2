"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

Each choice (``n`` per prompt) is its own engine request; they run concurrently and stream back
merged. The request's ``model`` is not checked: the server answers with the model it serves.
Errors take OpenAI's shape and a 400 for bad input (``server/errors.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from flashserve.engine.outputs import RequestOutput, TokenOutput
from flashserve.engine.protocol import EngineClient
from flashserve.sampling.params import SamplingParams
from server.errors import APIError, documented, openai_error_body
from server.openai_output import (
    Choice,
    chat_logprobs,
    close_all,
    completion_logprobs,
    finish_reason,
    merged,
)
from server.openai_schemas import (
    DEFAULT_COMPLETION_TOKENS,
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatChunkChoice,
    ChatRequest,
    ChatResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    ParamError,
    PromptTokensDetails,
    Usage,
)
from server.routing import STREAM, admit, collect, engine_of, unless_disconnected

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
_STARTED = int(time.time())
Streams = list[AsyncGenerator[RequestOutput, None]]
# OpenAI answers 400 where TGI says 422; "default": any other error, in OpenAI's shape
_ERRORS = documented(400, 401, 408, 413, 424, 429, 500, 503, "default", openai=True)


@dataclass
class _Run:
    """A request's engine requests, started: each choice's first output and its stream."""

    id: str
    model: str
    created: int
    firsts: list[RequestOutput]
    streams: Streams


@router.get("/models", responses=documented(401, 503, openai=True))
async def models(request: Request) -> ModelList:
    return ModelList(data=[_card(request.app.state.llm)])


@router.get("/models/{model_id:path}", responses=documented(401, 404, 503, "default",
                                                                openai=True))  # fmt: skip
async def model(model_id: str, request: Request) -> ModelCard:
    card = _card(request.app.state.llm)
    if model_id != card.id:
        raise APIError(404, f"the model {model_id!r} does not exist", "http", "model",
                       "model_not_found")  # fmt: skip
    return card


@router.post("/completions", response_model=CompletionResponse, responses={**STREAM, **_ERRORS})
async def completions(
    body: CompletionRequest, request: Request
) -> CompletionResponse | StreamingResponse:
    llm = engine_of(request)
    with _validating():
        body.check()
        prompts = body.prompts()
        _check_choices(request, len(prompts), body.n)
        ids = [await _encode(llm, p, "prompt") for p in prompts]
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_TOKENS
        for p in ids:
            _check_context(llm, len(p), max_tokens)
        params = [body.sampling_params(max_tokens, body.logprobs, j) for j in range(body.n)]
    echoes = [(p if isinstance(p, str) else llm.tokenizer.decode(i)) if body.echo else ""
              for p, i in zip(prompts, ids)]  # fmt: skip
    jobs = [(p, sp) for p in ids for sp in params]
    await admit(request, len(jobs))
    run = await _start(request, llm, "cmpl", jobs)
    choices = [Choice(k) for k in range(len(jobs))]
    for c in choices:
        c.offset = len(echoes[c.index // body.n])
    prompt_tokens = sum(map(len, ids))
    if body.stream:
        events = _completion_events(body, run, choices, echoes, prompt_tokens)
        return StreamingResponse(events, media_type="text/event-stream")
    results = await _finish(request, run)
    out = []
    for c, (tokens, last) in zip(choices, results):
        lp = completion_logprobs(tokens, c) if body.logprobs is not None else None
        text = echoes[c.index // body.n] + last.generated_text
        out.append(CompletionChoice(index=c.index, text=text, logprobs=lp,
                                    finish_reason=finish_reason(last)))  # fmt: skip
    usage = _usage(prompt_tokens, [last for _, last in results], body.n)
    return CompletionResponse(id=run.id, created=run.created, model=run.model, choices=out,
                              usage=usage)  # fmt: skip


@router.post("/chat/completions", response_model=ChatResponse, responses={**STREAM, **_ERRORS})
async def chat_completions(body: ChatRequest, request: Request) -> ChatResponse | StreamingResponse:
    llm = engine_of(request)
    with _validating():
        body.check()
        _check_choices(request, 1, body.n)
        ids = await _chat_prompt(llm, body)
        max_tokens = body.max_new_tokens or llm.max_model_len - len(ids)
        _check_context(llm, len(ids), max_tokens, body.max_new_tokens is not None)
        params = [body.sampling_params(max_tokens, body.engine_logprobs, j) for j in range(body.n)]
    await admit(request, body.n)
    run = await _start(request, llm, "chatcmpl", [(ids, sp) for sp in params])
    if body.stream:
        events = _chat_events(body, run, len(ids))
        return StreamingResponse(events, media_type="text/event-stream")
    results = await _finish(request, run)
    top_n = body.top_logprobs or 0
    choices = [
        ChatChoice(
            index=k,
            message=AssistantMessage(content=last.generated_text),
            logprobs=chat_logprobs(tokens, top_n) if body.logprobs else None,
            finish_reason=finish_reason(last),
        )
        for k, (tokens, last) in enumerate(results)
    ]
    usage = _usage(len(ids), [last for _, last in results], body.n)
    return ChatResponse(id=run.id, created=run.created, model=run.model, choices=choices,
                        usage=usage)  # fmt: skip


# ---- preparing -----------------------------------------------------------------------------


@contextmanager
def _validating(param: str | None = None) -> Iterator[None]:
    """A ValueError (ours, SamplingParams', the engine's request checks) becomes a 400 naming
    its parameter (``param`` when the error does not say)."""
    try:
        yield
    except ValueError as exc:
        param, code = getattr(exc, "param", param), getattr(exc, "code", None)
        raise APIError(400, str(exc), "validation", param, code) from exc


def _check_choices(request: Request, prompts: int, n: int) -> None:
    """Every choice is an engine request that takes an admission slot: refuse, before any
    tokenizing, more than ``--max-choices-per-request`` of them, or more than could ever run
    at once (``--max-concurrent-requests``)."""
    settings = request.app.state.settings
    k, param = prompts * n, "prompt" if prompts > 1 else "n"
    asked = f"this request asks for {k} completions ({prompts} prompt(s) x n={n})"
    if k > settings.max_choices_per_request:
        raise ParamError(param, f"{asked}; the server allows at most "
                         f"{settings.max_choices_per_request} per request")  # fmt: skip
    running = settings.max_concurrent_requests
    if running is not None and k > running:
        raise ParamError(param, f"{asked}; the server runs at most {running} at once")


async def _encode(llm: EngineClient, prompt: str | list[int], param: str) -> list[int]:
    """Token ids, on a worker thread; text that cannot fit the context is refused unread."""
    if isinstance(prompt, str):
        least = llm.tokenizer.min_tokens(prompt)
        if least > llm.max_model_len:
            raise ParamError(param, f"This model's maximum context length is "
                             f"{llm.max_model_len} tokens. However, the prompt has at least "
                             f"{least} tokens ({len(prompt)} characters). Please reduce the "
                             "length of the prompt.", "context_length_exceeded")  # fmt: skip
        return await asyncio.to_thread(llm.tokenizer.encode, prompt)
    return list(prompt)  # the engine checks the ids against the vocabulary


async def _chat_prompt(llm: EngineClient, body: ChatRequest) -> list[int]:
    """The conversation rendered by the model's chat template, as token ids."""
    messages = [m.for_template() for m in body.messages]
    try:
        text = await asyncio.to_thread(llm.tokenizer.apply_chat_template, messages)
    except ValueError as exc:
        raise ParamError("messages", str(exc)) from exc
    return await _encode(llm, text, "messages")


def _check_context(llm: EngineClient, prompt: int, max_tokens: int, asked: bool = True) -> None:
    """Prompt plus completion must fit the context: OpenAI's message, naming both numbers."""
    limit = llm.max_model_len
    if prompt + max_tokens <= limit and max_tokens > 0:
        return
    if asked:
        detail = (f"you requested {prompt + max_tokens} tokens ({prompt} in the prompt, "
                  f"{max_tokens} in the completion)")  # fmt: skip
    else:
        detail = f"the prompt has {prompt} tokens, leaving no room for a completion"
    raise ParamError(
        "max_tokens" if asked else "messages",
        f"This model's maximum context length is {limit} tokens. However, {detail}. Please "
        "reduce the length of the prompt or the completion.",
        "context_length_exceeded",
    )


async def _start(
    request: Request, llm: EngineClient, kind: str, jobs: list[tuple[list[int], SamplingParams]]
) -> _Run:
    """Submit every choice's request and wait for their first outputs, so that the engine's
    checks answer with a 400 before any response has started."""
    streams = [llm.generate(ids, params) for ids, params in jobs]
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        with _validating("prompt" if kind == "cmpl" else "messages"):
            firsts = await unless_disconnected(request, asyncio.gather(*tasks))
    except BaseException:
        await close_all(streams, tasks)
        raise
    rid = f"{kind}-{uuid.uuid4().hex}"
    return _Run(rid, llm.model_name, int(time.time()), firsts, streams)


async def _finish(request: Request, run: _Run) -> list[tuple[list[TokenOutput], RequestOutput]]:
    """Every choice's tokens and last output; a 424 if the engine failed one."""
    work = asyncio.gather(*(collect(f, s) for f, s in zip(run.firsts, run.streams)))
    try:
        results = await unless_disconnected(request, work)
    finally:
        await close_all(run.streams)
    for _, last in results:
        if last.finish_reason == "error":
            raise APIError(424, last.error or "generation failed", "generation")
    return results


def _usage(prompt_tokens: int, lasts: list[RequestOutput], n: int) -> Usage:
    """``lasts``: every choice's last output, in choice order, ``n`` choices per prompt.

    A prompt counts once in ``prompt_tokens`` however many choices it has (OpenAI's rule), so
    it counts once in ``cached_tokens`` too: the tokens that every one of its choices found in
    the prefix cache (its choices are engine requests of their own, and a later one may find
    what an earlier one computed), which keeps ``cached_tokens <= prompt_tokens``."""
    completion = sum(last.num_generated_tokens for last in lasts)
    cached = sum(min(last.num_cached_tokens for last in lasts[i : i + n])
                 for i in range(0, len(lasts), n))  # fmt: skip
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion,
                 total_tokens=prompt_tokens + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))  # fmt: skip


def _card(llm: EngineClient) -> ModelCard:
    return ModelCard(id=llm.model_name, created=_STARTED, max_model_len=llm.max_model_len)


# ---- streaming -------------------------------------------------------------------------------


async def _completion_events(
    body: CompletionRequest, run: _Run, choices: list[Choice], echoes: list[str], prompt: int
) -> AsyncIterator[str]:
    def chunk(index: int, text: str, lp=None, reason: str | None = None) -> str:
        c = CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=reason)
        return _sse(CompletionResponse(id=run.id, created=run.created, model=run.model,
                                       choices=[c]))  # fmt: skip

    usage_object = "text_completion" if body.include_usage else None
    for c in choices:
        if echoes[c.index // body.n]:
            yield chunk(c.index, echoes[c.index // body.n])
    async for index, out in _outputs(run, usage_object, prompt, body.n):
        if isinstance(out, str):
            yield out
            continue
        c = choices[index]
        text, reason = c.delta(out), finish_reason(out)
        lp = completion_logprobs(out.new_tokens, c) if body.logprobs is not None else None
        if text or reason or (lp and lp.tokens):
            yield chunk(index, text, lp, reason)


async def _chat_events(body: ChatRequest, run: _Run, prompt: int) -> AsyncIterator[str]:
    def chunk(index: int, delta: dict, lp=None, reason: str | None = None) -> str:
        c = ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=reason)
        return _sse(ChatChunk(id=run.id, created=run.created, model=run.model, choices=[c]))

    usage_object = "chat.completion.chunk" if body.include_usage else None
    choices = [Choice(k) for k in range(body.n)]
    for c in choices:
        yield chunk(c.index, {"role": "assistant", "content": ""})
    async for index, out in _outputs(run, usage_object, prompt, body.n):
        if isinstance(out, str):
            yield out
            continue
        text, reason = choices[index].delta(out), finish_reason(out)
        lp = chat_logprobs(out.new_tokens, body.top_logprobs or 0) if body.logprobs else None
        if text or reason or (lp and lp.content):
            yield chunk(index, {"content": text} if text else {}, lp, reason)


async def _outputs(
    run: _Run, usage_object: str | None, prompt: int, n: int
) -> AsyncIterator[tuple[int, RequestOutput | str]]:
    """Every choice's outputs as they come, then the usage chunk (a ``usage_object``, when
    set; ``n`` choices per prompt) and ``[DONE]`` as ready SSE lines. An engine failure ends
    the stream with an error event: once the 200 is out, that is the only way left to tell."""
    lasts: dict[int, RequestOutput] = {}  # choice -> its last output (they finish in any order)
    try:
        async with aclosing(merged(run.firsts, run.streams)) as outputs:
            async for index, out in outputs:
                if out.finish_reason == "error":
                    yield index, _sse(openai_error_body(out.error or "generation failed",
                                                        "generation"))  # fmt: skip
                    break
                if out.finished:
                    lasts[index] = out
                yield index, out
            else:
                if usage_object:
                    usage = _usage(prompt, [lasts[k] for k in sorted(lasts)], n).model_dump()
                    chunk = {"id": run.id, "object": usage_object, "created": run.created,
                             "model": run.model, "choices": [], "usage": usage}  # fmt: skip
                    yield -1, _sse(chunk)
    except Exception:
        logger.exception("streaming %s failed", run.id)
        yield -1, _sse(openai_error_body("internal server error", "internal"))
    yield -1, "data: [DONE]\n\n"


def _sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"
