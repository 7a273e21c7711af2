"""What the HTTP server needs of an engine: the ``EngineClient`` protocol, and the per-request
stream plumbing its two implementations share.

- ``AsyncLLM`` (``flashserve.engine.async_llm``): the engine on a thread of this process, the
  Python API and the in-process tests;
- ``EngineCoreClient`` (``flashserve.engine.core_client``): the engine core in a process of its
  own, what ``flashserve serve`` runs.

The server reaches the engine only through this interface: no route reads the engine's objects.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from flashserve.config import EngineConfig
from flashserve.engine.messages import EngineStats
from flashserve.engine.outputs import RequestOutput
from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class RequestStats:
    """One request's timings (``time.monotonic()`` seconds) and token counts."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # inter-token latencies
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    finish_reason: str | None = None  # None: the caller went away before the end
    last_token: float | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason in (None, "abort")


class EngineClient(Protocol):
    """An engine as the server sees it.

    Attributes: ``config`` (the resolved ``EngineConfig``), ``tokenizer`` (the model's, for
    chat templates, truncation and length checks in the caller's process), ``model_name``,
    ``max_model_len``, ``kv_cache_tokens`` and ``kv_cache_bytes`` (the KV pool's size, in the
    resolved ``config.kv_cache_dtype``), and ``on_finished``: callbacks given each request's
    ``RequestStats`` on the request's event loop when it ends (metrics)."""

    config: EngineConfig
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    kv_cache_tokens: int
    kv_cache_bytes: int
    on_finished: list[Callable[[RequestStats], None]]

    def start(self) -> None:
        """Start serving; called once, from the event loop that will call ``generate``."""

    def shutdown(self) -> None:
        """Stop: open requests end with an error; blocks until the engine has stopped."""

    @property
    def is_running(self) -> bool: ...

    def stalled_reason(self, stall_timeout: float) -> str | None:
        """Why the engine is dead, or None while it makes progress (the watchdog's verdict):
        dead when it is gone, or work is pending and its heartbeat is older than
        ``stall_timeout`` seconds."""

    def stats(self) -> EngineStats | None:
        """The engine's latest gauges (None before it published any)."""

    def check_text_fits(self, text: str) -> None:
        """Raise ValueError if ``text`` cannot fit the context, judged from its length alone."""

    def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError before the first one if it is bad.
        Closing the iterator early aborts the request."""

    def abort(self, request_id: str) -> None: ...

    def fail_requests(self, error: str) -> None:
        """End every open request, and every one added later, with an error output saying
        ``error``: the shutdown's cut, so that each stream ends with its error event."""


def new_request_id(running: bool, streams: dict, request_id: str | None) -> str:
    """A new request's id: ``request_id``, or a fresh one. RuntimeError where the engine is
    not ``running``; ValueError where ``streams`` (the open requests by id) holds it."""
    if not running:
        raise RuntimeError("the engine is not running")
    rid = request_id or uuid.uuid4().hex
    if rid in streams:
        raise ValueError(f"request id {rid!r} is already in use")
    return rid


async def relay(
    stream: asyncio.Queue,
    stats: RequestStats,
    on_finished: list[Callable[[RequestStats], None]],
    streams: dict,
    rid: str,
    abort: Callable[[str], None],
) -> AsyncIterator[RequestOutput]:
    """Yield the outputs that arrive on ``stream`` as ``(when, output)`` until the finished
    one, folding each into ``stats``; then, or when the caller stops early, drop ``rid``
    from ``streams``, ``abort`` it if it is unfinished, and report ``stats``."""
    finished = False
    try:
        while not finished:
            when, out = await stream.get()
            _record(stats, when, out)
            finished = out.finished
            yield out
    finally:
        streams.pop(rid, None)
        if not finished:
            abort(rid)
        stats.finished = time.monotonic()
        for callback in on_finished:
            try:
                callback(stats)
            except Exception:  # metrics must never break a request
                logger.exception("an on_finished callback failed")


def _record(stats: RequestStats, when: float, out: RequestOutput) -> None:
    """Fold one output, delivered by the engine at ``when``, into the request's stats."""
    if out.new_tokens:
        if stats.first_token is None:
            stats.first_token = when
        else:
            stats.token_gaps.append(when - stats.last_token)
        stats.last_token = when
    stats.num_generated_tokens = out.num_generated_tokens
    if out.finished:
        stats.finish_reason = out.finish_reason
