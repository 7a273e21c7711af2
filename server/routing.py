"""Route helpers shared by the TGI and OpenAI routes: the engine of the app, admission,
collecting a request's outputs, cancelling work when the client goes away, the streamed-200
schema."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from fastapi import Request

from flashserve.engine.outputs import RequestOutput, TokenOutput
from flashserve.engine.protocol import EngineClient
from server.admission import TICKET
from server.errors import APIError

T = TypeVar("T")
# for the OpenAPI schema: a 200 that is (or, with ``stream``, may be) Server-Sent Events, each
# event described by ``itemSchema`` (OpenAPI 3.2's way, as FastAPI's own SSE routes do)
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
STREAM = {200: {"description": "the answer; streamed as Server-Sent Events when asked to",
                "content": {"text/event-stream": {"itemSchema": _EVENT}}}}  # fmt: skip


def engine_of(request: Request) -> EngineClient:
    """The app's engine; 503 when it is not running."""
    llm: EngineClient = request.app.state.llm
    if not llm.is_running:
        raise APIError(503, "the engine is not running", "unavailable")
    return llm


async def admit(request: Request, k: int = 1) -> None:
    """Take ``k`` admission slots (one per engine request the route will start) for the rest
    of the request: call it once the request is validated, before starting generations. While
    it waits in the queue it watches the client: one that goes away leaves the queue at once
    (499), and its place goes to the next. Raises APIError 429 or 503 (``server.admission``)."""
    ticket = getattr(request.state, TICKET, None)
    if ticket is not None:  # None: an app without the Gate (no admission control)
        await unless_disconnected(request, ticket.acquire(k))


async def collect(
    first: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
) -> tuple[list[TokenOutput], RequestOutput]:
    """Every token of a request, from its first output to its last."""
    tokens, last = list(first.new_tokens), first
    if not first.finished:
        async for last in outputs:
            tokens.extend(last.new_tokens)
    return tokens, last


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts the request in
    the engine) and answer 499."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "the client closed the request", "client_closed")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
