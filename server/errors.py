"""Every error the API returns, in one place: TGI's ``{"error": ..., "error_type": ...}`` body.

- a request the server cannot serve as given (bad JSON, wrong types, out-of-range parameters,
  a prompt too long for the context): 422 ``validation``;
- a generation that failed inside the engine: 424 ``generation`` (as TGI);
- the engine not running: 503 ``unavailable``;
- the client disconnected before the answer: 499 ``client_closed`` (for the access log only);
- anything unexpected: 500 ``internal``; the traceback goes to the log, never to the client.

Once a stream has started, errors travel as an event with the same body (``server/tgi.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status and TGI error type, raised by the routes."""

    def __init__(self, status_code: int, message: str, error_type: str):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type


def error_body(message: str, error_type: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


@contextmanager
def validating() -> Iterator[None]:
    """Turn a ValueError (SamplingParams, the engine's request checks) into a 422."""
    try:
        yield
    except ValueError as exc:
        raise APIError(422, str(exc), "validation") from exc


def describe_validation_error(exc: RequestValidationError) -> str:
    """One line per problem: ``parameters.top_k: Input should be a valid integer``."""
    lines = []
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            lines.append(f"invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}")
            continue
        loc = [str(part) for part in err.get("loc", ()) if part != "body"]
        lines.append(f"{'.'.join(loc) or 'body'}: {err['msg']}")
    return "; ".join(lines) or "invalid request"


def register_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_CatchUnexpected)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.error_type), status_code=exc.status_code)


async def _request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(error_body(describe_validation_error(exc), "validation"), status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        error_body(str(exc.detail), "http"), status_code=exc.status_code, headers=exc.headers
    )


class _CatchUnexpected:
    """Any other exception: a 500 JSON body, the traceback to the log. (Starlette's own handler
    for ``Exception`` re-raises after answering, and the server then resets the connection.)"""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:  # too late for a status code: let the server close the connection
                raise
            logger.exception("unexpected error on %s %s", scope["method"], scope["path"])
            body = error_body("internal server error", "internal")
            await JSONResponse(body, status_code=500)(scope, receive, send)
