"""The FastAPI application: ``build_app`` wires the engine, the error handlers and the routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import flashserve
from flashserve.async_llm import AsyncLLM
from flashserve.config import EngineConfig
from server import openai, tgi
from server.errors import register_error_handlers


def build_app(
    config: EngineConfig | None = None, llm: AsyncLLM | None = None, raw_prompts: bool = False
) -> FastAPI:
    """An app serving ``llm``, or an engine built from ``config`` (the default model if None).

    The engine lives as long as the app's lifespan: it is loaded (when not given), started on
    startup and shut down on exit; the routes find it on ``app.state.llm``. A given ``llm`` must
    not be started yet: the app owns it from here on. ``raw_prompts`` turns off wrapping plain
    ``inputs`` in the model's chat template (text-generation-inference's exact behaviour).
    """
    if config is not None and llm is not None:
        raise ValueError("pass an engine config or an engine, not both")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = llm or await asyncio.to_thread(AsyncLLM, config or EngineConfig())
        engine.start()
        app.state.llm = engine
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="flashserve", version=flashserve.__version__, lifespan=lifespan)
    app.state.raw_prompts = raw_prompts
    register_error_handlers(app)
    app.include_router(tgi.router)
    app.include_router(openai.router)
    return app
