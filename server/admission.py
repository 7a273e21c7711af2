"""Admission control and the ingress of generation requests.

The ``Gate`` middleware stands in front of every route. It refuses new requests while the
server drains for shutdown and counts the requests in flight, so that the shutdown knows when
it may stop. For a generation request it first reads the whole body, under a size limit (413,
at once when ``Content-Length`` says so) and a deadline (408), so that a client can neither
fill the memory nor hold anything while it sends slowly; then the app sees the body, replayed.

Admission comes after validation: the Gate leaves a ``Ticket`` in the request's state, and
the route, once the request is known to be good and how many engine requests it will start,
takes that many slots (``server.routing.admit``). At most C engine requests run at once and at
most Q more requests wait for slots; past both, a request is refused at once (429
``overloaded`` with ``Retry-After``); one that waits longer than the queue timeout gets a 503.
Slots go to waiters first come, first served. The Gate gives the slots back when the app
returns, which for a stream is when the stream ends.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, error_response
from server.settings import ServerSettings

RETRY_AFTER_S = 1
# the routes that start generations and hold slots until their answer (or stream) ends
GENERATION_ROUTES = frozenset(["/", "/generate", "/generate_stream", "/v1/completions",
                               "/v1/chat/completions"])  # fmt: skip
# answered during the drain too: probes and scrapes
ALWAYS_OPEN = frozenset(["/health", "/ready", "/metrics"])
TICKET = "admission"  # the ticket's key in the request's state (``request.state.admission``)


class Admission:
    """Slots for engine requests; one instance per app, used from its event loop only."""

    def __init__(self, max_concurrent: int | None, max_queued: int, queue_timeout: float):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.running = 0  # slots taken
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, k: int = 1) -> None:
        """Take ``k`` slots, waiting in the queue if need be; raises APIError 429 or 503.
        ``k`` must not exceed ``max_concurrent`` (the routes refuse such requests first)."""
        if self.max_concurrent is not None and k > self.max_concurrent:
            raise ValueError(f"{k} slots can never be free at once: {self.max_concurrent} exist")
        if not self._waiters and self._fits(k):
            self.running += k
            return
        if len(self._waiters) >= self.max_queued:
            raise APIError(429, "Model is overloaded", "overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        entry = (k, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await asyncio.wait({entry[1]}, timeout=self.queue_timeout)
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(entry)
            raise
        if not entry[1].done():
            self._leave(entry)
            raise APIError(503, f"the request waited {self.queue_timeout:g} s in the queue",
                           "unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip

    def release(self, k: int = 1) -> None:
        """Give ``k`` slots back; waiters at the head of the queue take them in order."""
        self.running -= k
        self._grant()

    def _fits(self, k: int) -> bool:
        return self.max_concurrent is None or self.running + k <= self.max_concurrent

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            k, slot = self._waiters.popleft()
            self.running += k  # the slots change hands
            slot.set_result(None)

    def _leave(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """Leave the queue: slots handed over in the meantime go back; a waiter that stood at
        the head may have kept smaller requests behind it waiting."""
        k, slot = entry
        if slot.done():
            self.release(k)
        else:
            slot.cancel()
            self._waiters.remove(entry)
            self._grant()


class Ticket:
    """One request's claim on admission: the route takes slots with ``acquire``, the Gate
    gives back what it holds with ``release`` when the app returns."""

    def __init__(self, admission: Admission, on_queued: Callable[[float], None]) -> None:
        self._admission = admission
        self._on_queued = on_queued  # the time spent waiting, for the queue-time metric
        self.held = 0

    async def acquire(self, k: int) -> None:
        start = time.monotonic()
        await self._admission.acquire(k)
        self.held += k
        self._on_queued(time.monotonic() - start)

    def release(self) -> None:
        if self.held:
            self._admission.release(self.held)
            self.held = 0


class Gate:
    """ASGI middleware: refuses requests while draining, counts requests in flight, reads a
    generation request's body under the size limit and deadline, and gives the request an
    admission ticket whose slots it releases when the app returns."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, state) -> None:
        self.app = app
        self.settings = settings
        self.state = state  # the app's state: draining, in_flight, llm, metrics (build_app's)
        self.admission = Admission(
            settings.max_concurrent_requests, settings.max_queued_requests, settings.queue_timeout
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in ALWAYS_OPEN:
            return await self.app(scope, receive, send)
        if self.state.draining:
            response = error_response(path, 503, "the server is shutting down", "unavailable",
                                      headers={"Connection": "close"})  # fmt: skip
            return await response(scope, receive, send)
        self.state.in_flight += 1
        try:
            if scope["method"] == "POST" and path in GENERATION_ROUTES:
                await self._generation(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _generation(self, scope: Scope, receive: Receive, send: Send) -> None:
        llm = getattr(self.state, "llm", None)
        limit = self.settings.request_bytes_limit(getattr(llm, "max_model_len", None))
        try:
            body = await read_body(scope, receive, limit, self.settings.request_read_timeout)
        except APIError as exc:
            response = error_response(scope["path"], exc.status_code, exc.message,
                                      exc.error_type, headers=exc.headers)  # fmt: skip
            return await response(scope, receive, send)
        ticket = Ticket(self.admission, self._observe_queue_time)
        scope.setdefault("state", {})[TICKET] = ticket
        try:
            await self.app(scope, _replaying(body, receive), send)
        finally:
            ticket.release()

    def _observe_queue_time(self, seconds: float) -> None:
        metrics = getattr(self.state, "metrics", None)
        if metrics is not None:
            metrics.queue_time.observe(seconds)


async def read_body(scope: Scope, receive: Receive, limit: int, timeout: float) -> bytes:
    """The whole request body. APIError 413 when it is over ``limit`` bytes (at once, unread,
    when its Content-Length says so), 408 when it is not complete within ``timeout`` seconds,
    499 when the client goes away. Both refusals close the connection: what the client is
    still sending will not be read."""
    close = {"Connection": "close"}
    too_large = APIError(413, f"the request body is over the limit of {limit} bytes "
                         "(--max-request-bytes)", "validation", headers=close)  # fmt: skip
    declared = _content_length(scope)
    if declared is not None and declared > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise APIError(499, "the client closed the request", "client_closed")
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s "
                       "(--request-read-timeout)", "timeout", headers=close) from None  # fmt: skip


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP server refuses such requests before they get here
                return None
    return None


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body read, then passes the real one through (so that the
    routes still see the client's ``http.disconnect``)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if replayed:
            return await receive()
        replayed = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
