"""The server's own settings (the engine's are ``flashserve.config.EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerSettings:
    """Admission control, shutdown, the watchdog and security; the defaults change nothing for
    a local server (no limits, no key, no CORS).

    - ``max_concurrent_requests``: generation requests served at once (None: no limit);
    - ``max_queued_requests``: requests that may wait for one of those slots; past both, 429;
    - ``queue_timeout``: seconds a request may wait in that queue before a 503;
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
        for name in ("queue_timeout", "shutdown_timeout", "stall_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.dead_exit_delay is not None and self.dead_exit_delay < 0:
            raise ValueError("dead_exit_delay must not be negative")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must not be empty")
        self.allowed_origins = tuple(self.allowed_origins)
