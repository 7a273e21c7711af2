"""Every error the API returns, in one place: TGI's ``{"error": ..., "error_type": ...}`` body.

- a request the server cannot serve as given (bad JSON or a body that cannot be read, wrong
  types, out-of-range parameters, a prompt too long for the context): 422 ``validation``;
- a body over ``--max-request-bytes``: 413 ``validation``; a body that does not arrive within
  ``--request-read-timeout`` seconds: 408 ``timeout`` (both close the connection);
- a generation that failed inside the engine: 424 ``generation`` (as TGI);
- the engine not running, the server draining for shutdown, a request that waited in the
  admission queue too long: 503 ``unavailable``;
- past ``--max-concurrent-requests`` plus ``--max-queued-requests``: 429 ``overloaded``, with
  ``Retry-After``;
- no or a wrong API key: 401 ``unauthorized``, with ``WWW-Authenticate: Bearer``;
- the client disconnected before the answer: 499 ``client_closed`` (for the access log only);
- anything unexpected: 500 ``internal``; the traceback goes to the log, never to the client.

Once a stream has started, errors travel as an event with the same body (``server/tgi.py``).

On the OpenAI routes (``/v1/...``) the same errors take OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, and a request that cannot be served as sent
is a 400 ``invalid_request_error`` (OpenAI's status) instead of a 422.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with its HTTP status and TGI error type, raised by the routes; ``param`` and
    ``code`` only show in OpenAI-shaped bodies."""

    def __init__(
        self,
        status_code: int,
        message: str,
        error_type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.headers = headers


class ErrorResponse(BaseModel):
    """TGI's error body (the OpenAPI schema's; the handlers build the dict directly)."""

    error: str
    error_type: str


class OpenAIError(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: OpenAIError


_STATUS_TEXT = {
    400: "the request cannot be served as sent",
    401: "no or a wrong API key",
    404: "no such model",
    408: "the request body did not arrive within --request-read-timeout seconds",
    413: "the request body is over --max-request-bytes",
    422: "the request cannot be served as sent",
    424: "the generation failed in the engine",
    429: "overloaded: past the concurrency and queue limits (Retry-After)",
    500: "an unexpected error",
    503: "the engine is not running, the server drains, or the request waited too long",
    "default": "any other error",
}


def documented(*statuses: int | str, openai: bool = False) -> dict:
    """OpenAPI ``responses`` for these error statuses, in the route's error shape."""
    model = OpenAIErrorResponse if openai else ErrorResponse
    return {s: {"model": model, "description": _STATUS_TEXT[s]} for s in statuses}


def error_body(message: str, error_type: str) -> dict[str, str]:
    return {"error": message, "error_type": error_type}


# TGI error types -> OpenAI's
_OPENAI_TYPES = {"generation": "server_error", "internal": "server_error",
                 "unavailable": "server_error", "overloaded": "server_error"}  # fmt: skip


def openai_error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    """OpenAI's error body; ``error_type`` is a TGI type, mapped onto OpenAI's."""
    kind = _OPENAI_TYPES.get(error_type, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def is_openai_path(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


def error_response(
    path: str, status: int, message: str, error_type: str, param: str | None = None,
    code: str | None = None, headers: dict[str, str] | None = None,
) -> JSONResponse:  # fmt: skip
    """The error response in the shape of the route's API (for middlewares, which answer
    before any route runs)."""
    if not is_openai_path(path):
        return JSONResponse(error_body(message, error_type), status_code=status, headers=headers)
    status = 400 if status == 422 else status
    body = openai_error_body(message, error_type, param, code)
    return JSONResponse(body, status_code=status, headers=headers)


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
    path = request.url.path
    return error_response(path, exc.status_code, exc.message, exc.error_type, exc.param, exc.code,
                          exc.headers)  # fmt: skip


async def _request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message = describe_validation_error(exc)
    return error_response(request.url.path, 422, message, "validation", _first_param(exc))


def _first_param(exc: RequestValidationError) -> str | None:
    """The field of the first problem (``messages.0.role``); None for the body as a whole."""
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            return None
        loc = []
        for part in err.get("loc", ())[1:]:  # after "body"
            if (isinstance(part, str) and not part.isidentifier()) or part in _TYPE_TAGS:
                break  # a union member's tag (``str``, ``list[str]``): not a field
            loc.append(str(part))
        return ".".join(loc) or None
    return None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    path, status = request.url.path, exc.status_code
    if status == 400:  # FastAPI could not read the body (e.g. not UTF-8): a bad request, 422
        return error_response(path, 422, str(exc.detail), "validation")
    return error_response(path, status, str(exc.detail), "http", headers=exc.headers)


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
            response = error_response(scope["path"], 500, "internal server error", "internal")
            await response(scope, receive, send)
