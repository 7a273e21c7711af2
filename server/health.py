"""Probes: ``/health`` (liveness) and ``/ready`` (readiness).

- ``/health``: 200 while the engine loop makes progress; 503 once the watchdog calls it dead
  (its thread is gone, or work is pending and its heartbeat is older than the stall timeout).
  A load balancer or orchestrator should restart the process on a 503.
- ``/ready``: 200 when the server takes requests; 503 while the engine loads and warms up,
  while it is dead, and while the server drains for shutdown. Route traffic by it.

Neither needs the API key.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from flashserve.engine.protocol import EngineClient
from server.errors import APIError, documented

router = APIRouter()


@router.get("/health", response_class=Response, responses=documented(503))
async def health(request: Request) -> Response:
    reason = _dead_reason(request)
    if reason is not None:
        raise APIError(503, reason, "unavailable")
    return Response(status_code=200)


@router.get("/ready", response_class=Response, responses=documented(503))
async def ready(request: Request) -> Response:
    state = request.app.state
    if not getattr(state, "ready", False):
        raise APIError(503, "the model is loading", "unavailable")
    if state.draining:
        raise APIError(503, "the server is shutting down", "unavailable")
    reason = _dead_reason(request)
    if reason is not None:
        raise APIError(503, reason, "unavailable")
    return Response(status_code=200)


def _dead_reason(request: Request) -> str | None:
    llm: EngineClient | None = getattr(request.app.state, "llm", None)
    if llm is None:
        return "the engine is not running"
    return llm.stalled_reason(request.app.state.settings.stall_timeout)
