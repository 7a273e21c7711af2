"""Admission control: at most C generation requests at once, at most Q more waiting for a slot.

Past both, a request is refused at once (429 ``overloaded`` with ``Retry-After``); a request
that waits longer than the queue timeout gets a 503. Slots go to waiters first come, first
served. The ``Gate`` middleware also refuses new requests while the server drains for shutdown
and counts the requests in flight, so that the shutdown knows when it may stop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError, error_response
from server.settings import ServerSettings

RETRY_AFTER_S = 1
# the routes that start generations and hold a slot until their answer (or stream) ends
GENERATION_ROUTES = frozenset(["/", "/generate", "/generate_stream", "/v1/completions",
                               "/v1/chat/completions"])  # fmt: skip
# answered during the drain too: probes and scrapes
ALWAYS_OPEN = frozenset(["/health", "/ready", "/metrics"])


class Admission:
    """Slots for generation requests; one instance per app, used from its event loop only."""

    def __init__(self, max_concurrent: int | None, max_queued: int, queue_timeout: float):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; raises APIError 429 or 503."""
        free = self.max_concurrent is None or self.running < self.max_concurrent
        if free and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise APIError(429, "Model is overloaded", "overloaded")
        slot = asyncio.get_running_loop().create_future()
        self._waiters.append(slot)
        try:
            await asyncio.wait({slot}, timeout=self.queue_timeout)
        except asyncio.CancelledError:  # the client went away while waiting
            self._leave(slot)
            raise
        if not slot.done():
            self._leave(slot)
            raise APIError(503, f"the request waited {self.queue_timeout:g} s in the queue",
                           "unavailable")  # fmt: skip

    def _leave(self, slot: asyncio.Future[None]) -> None:
        """Leave the queue; a slot handed over in the meantime goes to the next one."""
        if slot.done():
            self.release()
        else:
            slot.cancel()
            self._waiters.remove(slot)

    def release(self) -> None:
        """Give a slot back: to the first waiter, else to the pool."""
        if self.max_concurrent is None:
            self.running -= 1
            return
        while self._waiters:
            slot = self._waiters.popleft()
            if not slot.done():
                slot.set_result(None)  # the slot changes hands: ``running`` stays
                return
        self.running -= 1


class Gate:
    """ASGI middleware: refuses requests while draining, applies admission to generation
    routes, counts requests in flight and reports each one's queue time to ``on_queued``."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, state) -> None:
        self.app = app
        self.state = state  # the app's state: draining, in_flight, metrics (build_app's)
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
                await self._admitted(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.state.in_flight -= 1

    async def _admitted(self, scope: Scope, receive: Receive, send: Send) -> None:
        start = time.monotonic()
        try:
            await self.admission.acquire()
        except APIError as exc:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            response = error_response(scope["path"], exc.status_code, exc.message,
                                      exc.error_type, headers=headers)  # fmt: skip
            return await response(scope, receive, send)
        try:
            metrics = getattr(self.state, "metrics", None)
            if metrics is not None:
                metrics.queue_time.observe(time.monotonic() - start)
            await self.app(scope, receive, send)
        finally:
            self.admission.release()
