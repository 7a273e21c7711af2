"""The server's own settings (the engine's are ``flashserve.config.EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

# the default body limit: the longest prompt the context can hold, with margin. 32 bytes a token
# cover 8 ASCII characters (English text averages ~4 a token), a \uXXXX-escaped character
# (6 bytes) or a token id with its comma and space (up to 8); never under 1 MiB, so that a small
# context keeps room for the JSON around the text (chat turns, parameters)
BYTES_PER_CONTEXT_TOKEN = 32
MIN_REQUEST_BYTES = 2**20


@dataclass
class ServerSettings:
    """Admission control, request limits, shutdown, the watchdog and security; the defaults
    suit a local server (no concurrency limit, no key, no CORS) and still keep one client from
    freezing it (a body limit and read deadline, a bound on generations per request).

    - ``max_concurrent_requests``: generation requests served at once (None: no limit);
    - ``max_queued_requests``: requests that may wait for one of those slots; past both, 429;
      a request takes one slot per engine request it starts (its prompts x ``n``), and waits
      in the queue as one request;
    - ``queue_timeout``: seconds a request may wait in that queue before a 503;
    - ``max_request_bytes``: the largest body a generation request may have (413 past it);
      None: ``BYTES_PER_CONTEXT_TOKEN`` per token of the context, at least ``MIN_REQUEST_BYTES``
      (``request_bytes_limit``);
    - ``request_read_timeout``: seconds a client has to send the whole body (408 after);
    - ``max_choices_per_request``: engine requests one request may start (prompts x ``n``);
    - ``shutdown_timeout``: seconds in-flight requests get to finish after SIGTERM;
    - ``stall_timeout``: seconds without an engine heartbeat, while work is pending, after
      which ``/health`` calls the engine dead;
    - ``dead_exit_delay``: seconds the process stays up once the engine is dead (``/health``
      answers 503, open streams get their error event), then it exits with status 1 so that a
      supervisor restarts it; None: it stays up;
    - ``api_key``: when set, every route but /health, /ready and /metrics needs
      ``Authorization: Bearer <key>``;
    - ``allowed_origins``: CORS origins (none: no CORS headers at all).
    """

    max_concurrent_requests: int | None = None
    max_queued_requests: int = 0
    queue_timeout: float = 60.0
    max_request_bytes: int | None = None
    request_read_timeout: float = 30.0
    max_choices_per_request: int = 256
    shutdown_timeout: float = 30.0
    stall_timeout: float = 120.0
    dead_exit_delay: float | None = 10.0
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must not be negative")
        for name in ("queue_timeout", "request_read_timeout", "shutdown_timeout",
                     "stall_timeout", "max_choices_per_request"):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.max_request_bytes is not None and self.max_request_bytes < 1:
            raise ValueError("max_request_bytes must be positive")
        if self.dead_exit_delay is not None and self.dead_exit_delay < 0:
            raise ValueError("dead_exit_delay must not be negative")
        if self.api_key is not None:
            self.api_key = self.api_key.strip()  # a key read from a file keeps its newline
            if not self.api_key:
                raise ValueError("the API key must not be empty")
        self.allowed_origins = tuple(self.allowed_origins)

    def request_bytes_limit(self, max_model_len: int | None) -> int:
        """The body limit for a context of ``max_model_len`` tokens (None: not known yet)."""
        if self.max_request_bytes is not None:
            return self.max_request_bytes
        return max(MIN_REQUEST_BYTES, BYTES_PER_CONTEXT_TOKEN * (max_model_len or 0))
