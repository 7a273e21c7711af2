"""API-key authentication and CORS.

With a key set, every route except the probes (/health, /ready) and /metrics needs
``Authorization: Bearer <key>`` (what OpenAI's and text-generation-inference's clients send);
others get a 401 in the route's error shape. /metrics stays open, as in vLLM: it shows counts
and timings, never prompts; keep it off public networks. Keys are compared in constant time.
CORS is off unless origins are given.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import error_response

OPEN_ROUTES = frozenset(["/health", "/ready", "/metrics"])


class APIKeyMiddleware:
    """Refuses requests without the right bearer token (401, ``WWW-Authenticate: Bearer``)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES or self._allowed(scope):
            return await self.app(scope, receive, send)
        response = error_response(
            scope["path"], 401, "invalid or missing API key", "unauthorized",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )  # fmt: skip
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False


def add_api_key(app: FastAPI, api_key: str | None) -> None:
    if api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)


def add_cors(app: FastAPI, allowed_origins: tuple[str, ...]) -> None:
    """CORS for these origins; add it last, outside the key check (a browser's preflight
    carries no key)."""
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
        )
