"""Graceful shutdown: on SIGTERM (or SIGINT) stop taking requests, let those in flight finish,
then stop.

``DrainingServer`` is uvicorn's server with a drain in front of its own shutdown: the first
signal sets ``app.state.draining`` (new requests get 503, ``/ready`` says 503) and waits until
no request is in flight or ``shutdown_timeout`` has passed; then uvicorn closes the
connections, the app's lifespan stops the engine (and waits for the engine core process to
exit), and ``run()`` returns (exit status 0). A second signal skips the rest of the drain.
Requests still open when the timeout expires are ended with an error first
(``EngineClient.fail_requests``): each stream sends its error event and ends cleanly, instead
of being cut mid-way.

It also watches the engine: once the watchdog calls it dead (``EngineClient.stalled_reason``:
its thread or process is gone, or it stalls) for ``dead_exit_delay`` seconds, the server
stops with ``exit_status`` 1, so that a supervisor (Docker's restart policy, Kubernetes)
starts a fresh process instead of leaving one that can only answer 503.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SHUTTING_DOWN = "the server is shutting down"
# seconds the requests failed at the shutdown timeout get to send their error event and end:
# the engine thread fails them within a step, each stream then writes one event
CUT_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining ``app`` (built by ``build_app``) before it stops."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.app_state = app.state
        self.shutdown_timeout = shutdown_timeout
        self._deadline: float | None = None
        self._cut_deadline: float | None = None  # set once the open requests are failed
        self._dead_since: float | None = None
        self.exit_status = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._deadline is None:
            logger.info("draining: %d request(s) in flight, up to %g s",
                        self.app_state.in_flight, self.shutdown_timeout)  # fmt: skip
            self.app_state.draining = True
            self._deadline = time.monotonic() + self.shutdown_timeout
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        self._watch_engine()
        if self._deadline is not None and not self.should_exit:
            if self.app_state.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() > self._deadline:
                self._cut()
        return await super().on_tick(counter)

    def _cut(self) -> None:
        """Past the shutdown timeout: end every open request with an error, give the streams
        ``CUT_GRACE_S`` to send their error events, then stop."""
        now = time.monotonic()
        if self._cut_deadline is None:
            logger.warning("shutdown timeout: ending %d request(s) still in flight with an error",
                           self.app_state.in_flight)  # fmt: skip
            self._cut_deadline = now + CUT_GRACE_S
            llm = getattr(self.app_state, "llm", None)
            if llm is not None:
                llm.fail_requests(SHUTTING_DOWN)
        elif now > self._cut_deadline:
            self.should_exit = True

    def _watch_engine(self) -> None:
        state = self.app_state
        delay = state.settings.dead_exit_delay
        llm = getattr(state, "llm", None)
        if delay is None or llm is None or not getattr(state, "ready", False) or self.should_exit:
            return
        reason = llm.stalled_reason(state.settings.stall_timeout)
        if reason is None:
            self._dead_since = None
            return
        now = time.monotonic()
        if self._dead_since is None:
            self._dead_since = now
            logger.error("%s: exiting in %g s", reason, delay)
        if now - self._dead_since >= delay:
            logger.error("%s: exiting with status 1", reason)
            self.exit_status = 1
            self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handler for the signals; unlike uvicorn's, a drained signal is not raised again
        afterwards: the process exits normally, with status 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)
