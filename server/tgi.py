"""The text-generation-inference (TGI) routes: /generate, /generate_stream, /, /info (and
/health, in ``server/health.py``)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

import flashserve
from flashserve.engine.outputs import RequestOutput, TokenOutput
from flashserve.engine.protocol import EngineClient
from flashserve.sampling.params import SamplingParams
from server.errors import APIError, documented, error_body, validating
from server.routing import STREAM, admit, collect, engine_of, unless_disconnected
from server.schemas import (
    CompatGenerateRequest,
    Details,
    GenerateRequest,
    GenerateResponse,
    Info,
    StreamDetails,
    StreamResponse,
    Token,
    to_sampling_params,
)

logger = logging.getLogger(__name__)
router = APIRouter()
GENERATE_ERRORS = (401, 408, 413, 422, 429, 500, 503)


@router.get("/info", responses=documented(401, 503))
async def info(request: Request) -> Info:
    llm: EngineClient = request.app.state.llm
    return Info(
        model_id=llm.model_name,
        model_dtype=f"torch.{llm.config.dtype}",
        model_device_type=llm.config.device.split(":")[0],
        max_batch_size=llm.config.max_num_seqs,
        max_input_tokens=llm.max_model_len - 1,
        max_total_tokens=llm.max_model_len,
        prefix_caching=llm.config.enable_prefix_caching,
        tensor_parallel_size=llm.config.tensor_parallel_size,
        kv_cache_dtype=llm.config.kv_cache_dtype,
        kv_cache_tokens=llm.kv_cache_tokens,
        kv_cache_gib=round(llm.kv_cache_bytes / 2**30, 3),
        version=flashserve.__version__,
    )


@router.post("/generate", responses=documented(*GENERATE_ERRORS, 424))
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    llm = engine_of(request)
    prompt, params = await _prepare(request, llm, body)
    await admit(request)
    first, outputs = await _start(request, llm, prompt, params)
    try:
        tokens, last = await unless_disconnected(request, collect(first, outputs))
    finally:
        await outputs.aclose()
    if last.finish_reason == "error":
        raise APIError(424, last.error or "generation failed", "generation")
    text = _full_text(body, last.generated_text)
    if not body.parameters.details:
        return GenerateResponse(generated_text=text)
    details = Details(
        finish_reason=last.finish_reason or "length",
        generated_tokens=last.num_generated_tokens,
        seed=last.seed if body.parameters.sampling else None,
        tokens=[_token(t) for t in tokens],
        cached_tokens=last.num_cached_tokens,
    )
    return GenerateResponse(generated_text=text, details=details)


# response_class=Response (no media type): the 200 is documented by STREAM alone
@router.post(
    "/generate_stream",
    response_class=Response,
    responses={**STREAM, **documented(*GENERATE_ERRORS)},
)
async def generate_stream(body: GenerateRequest, request: Request) -> StreamingResponse:
    llm = engine_of(request)
    prompt, params = await _prepare(request, llm, body)
    await admit(request)
    first, outputs = await _start(request, llm, prompt, params)
    events = _events(body, first, outputs)
    return StreamingResponse(events, media_type="text/event-stream")


@router.post(
    "/",
    response_model=list[GenerateResponse],
    responses={**STREAM, **documented(*GENERATE_ERRORS, 424)},
)
async def compat_generate(
    body: CompatGenerateRequest, request: Request
) -> list[GenerateResponse] | StreamingResponse:
    """TGI's root route: a stream, or the response in a list; full text unless told not to."""
    if body.parameters.return_full_text is None:
        body.parameters.return_full_text = True
    if body.stream:
        return await generate_stream(body, request)
    return [await generate(body, request)]


# ---- helpers -------------------------------------------------------------------------------


async def _prepare(
    request: Request, llm: EngineClient, body: GenerateRequest
) -> tuple[str | list[int], SamplingParams]:
    """The prompt (text, or token ids with ``truncate``) and the sampling parameters; 422 when
    they are bad. The chat template and the tokenizer run on a worker thread: the inputs may
    be as long as the body limit allows, and the event loop must keep answering (/health)."""
    with validating():
        params = to_sampling_params(body.parameters)
        if not body.inputs:
            raise ValueError("`inputs` cannot be empty")
        truncate = body.parameters.truncate
        if truncate is not None and truncate >= llm.max_model_len:
            raise ValueError(
                f"`truncate` must be strictly positive and less than {llm.max_model_len}. "
                f"Given: {truncate}"
            )
        raw = request.app.state.raw_prompts
        prompt = await asyncio.to_thread(_as_prompt, llm, body.inputs, raw)
        if truncate is None:
            llm.check_text_fits(prompt)  # before admission: a slot is not spent on it
            return prompt, params
        # text longer than the context is legitimate here: the last ``truncate`` tokens are
        # kept. Only the body limit bounds the text tokenized.
        ids = await asyncio.to_thread(llm.tokenizer.encode, prompt)
        return ids[-truncate:], params


def _as_prompt(llm: EngineClient, inputs: str, raw: bool) -> str:
    """Plain text sent to a chat model becomes one user turn of its chat template (as Ollama's
    /api/generate does), so that a question gets an answer; text that already holds the
    template's special tokens, a model without a template, or ``--raw-prompts`` pass as is."""
    tok = llm.tokenizer
    if raw or tok.chat_template is None:
        return inputs
    specials = tok.convert_ids_to_tokens(sorted(tok.all_special_ids))
    if any(t and t in inputs for t in specials):
        return inputs
    return tok.apply_chat_template([{"role": "user", "content": inputs}])


async def _start(
    request: Request, llm: EngineClient, prompt: str | list[int], params: SamplingParams
) -> tuple[RequestOutput, AsyncGenerator[RequestOutput, None]]:
    """Submit the request and wait for its first output, so that the engine's checks (prompt
    length against the context) answer with a 422 before any response has started."""
    outputs = llm.generate(prompt, params)
    try:
        with validating():
            first = await unless_disconnected(request, anext(outputs))
    except BaseException:
        await outputs.aclose()
        raise
    return first, outputs


async def _events(
    body: GenerateRequest, first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
) -> AsyncIterator[str]:
    """One SSE event per token; the last one also carries generated_text and details. Once the
    200 header is out, an error can only travel as an event."""
    index = 0
    try:
        out = first
        while True:
            if out.finish_reason == "error":
                yield _sse(error_body(out.error or "generation failed", "generation"))
                return
            for i, tok in enumerate(out.new_tokens):
                index += 1
                last = out.finished and i == len(out.new_tokens) - 1
                yield _sse(_stream_event(body, index, tok, out if last else None))
            if out.finished:
                if not out.new_tokens:  # e.g. aborted between tokens: no token to carry it
                    yield _sse(_stream_event(body, index, None, out))
                return
            out = await anext(outputs)
    except Exception:
        logger.exception("generate_stream failed")
        yield _sse(error_body("internal server error", "internal"))
    finally:
        await outputs.aclose()


def _stream_event(
    body: GenerateRequest, index: int, tok: TokenOutput | None, final: RequestOutput | None
) -> StreamResponse:
    event = StreamResponse(index=index, token=_token(tok) if tok else None)
    if final is not None:
        event.generated_text = _full_text(body, final.generated_text)
        event.details = StreamDetails(
            finish_reason=final.finish_reason or "length",
            generated_tokens=final.num_generated_tokens,
            seed=final.seed if body.parameters.sampling else None,
            input_length=final.num_prompt_tokens,
            cached_tokens=final.num_cached_tokens,
        )
    return event


def _sse(payload: StreamResponse | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, StreamResponse) else json.dumps(payload)
    return f"data: {data}\n\n"


def _token(tok: TokenOutput) -> Token:
    return Token(id=tok.id, text=tok.text, logprob=tok.logprob, special=tok.special)


def _full_text(body: GenerateRequest, generated: str) -> str:
    return body.inputs + generated if body.parameters.return_full_text else generated
