"""The FastAPI application: ``build_app`` wires the engine, the error handlers, the middlewares
(CORS, request metrics, API key, admission) and the routes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import flashserve
from flashserve.config import EngineConfig
from flashserve.engine.async_llm import AsyncLLM
from flashserve.engine.protocol import EngineClient
from server import health, openai, tgi
from server.admission import Gate
from server.errors import register_error_handlers
from server.metrics import add_metrics
from server.security import add_api_key, add_cors
from server.settings import ServerSettings

logger = logging.getLogger(__name__)
WATCHDOG_PERIOD_S = 1.0


def build_app(
    config: EngineConfig | None = None,
    llm: EngineClient | None = None,
    raw_prompts: bool = False,
    settings: ServerSettings | None = None,
) -> FastAPI:
    """An app serving ``llm``, or an in-process engine (``AsyncLLM``) built from ``config``
    (the default model if None). ``flashserve serve`` passes an ``EngineCoreClient``, whose
    engine runs in a process of its own.

    The engine lives as long as the app's lifespan: it is loaded (when not given), started on
    startup and shut down on exit; the routes find it on ``app.state.llm``. A given ``llm`` must
    not be started yet: the app owns it from here on. ``raw_prompts`` turns off wrapping plain
    ``inputs`` in the model's chat template (text-generation-inference's exact behaviour).
    ``settings``: admission limits, timeouts, API key and CORS (none by default).
    """
    if config is not None and llm is not None:
        raise ValueError("pass an engine config or an engine, not both")
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = llm or await asyncio.to_thread(AsyncLLM, config or EngineConfig())
        engine.on_finished.append(app.state.metrics.observe)
        engine.start()
        app.state.llm = engine
        app.state.ready = True
        watchdog = asyncio.create_task(_watchdog(engine, settings.stall_timeout))
        try:
            yield
        finally:
            app.state.ready = False
            watchdog.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flashserve", version=flashserve.__version__, lifespan=lifespan)
    app.state.raw_prompts = raw_prompts
    app.state.settings = settings
    app.state.ready = False  # until the engine runs
    app.state.draining = False  # set by the SIGTERM handler (server/shutdown.py)
    app.state.in_flight = 0
    register_error_handlers(app)
    app.include_router(health.router)
    app.include_router(tgi.router)
    app.include_router(openai.router)
    # middlewares: the last added runs first
    app.add_middleware(Gate, settings=settings, state=app.state)
    add_api_key(app, settings.api_key)
    add_metrics(app)
    add_cors(app, settings.allowed_origins)
    return app


async def _watchdog(llm: EngineClient, stall_timeout: float) -> None:
    """Log when the engine dies or stalls, and when it recovers (/health answers the same)."""
    last: str | None = None
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        reason = llm.stalled_reason(stall_timeout)
        if reason != last:
            if reason is None:
                logger.warning("the engine makes progress again")
            else:
                logger.error("watchdog: %s", reason)
            last = reason
