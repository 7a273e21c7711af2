"""The engine on its own thread, with an async token stream per request.

The engine thread owns the ``LLMEngine``: it drains an inbox of new requests and aborts, runs
steps while there is work, and hands each output to the asyncio loop of the request that waits
for it. Callers never touch engine state directly.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator

from flashserve.config import EngineConfig
from flashserve.llm_engine import LLMEngine, Request
from flashserve.outputs import RequestOutput
from flashserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLM:
    """``generate()`` yields a ``RequestOutput`` per new token; closing it early aborts."""

    def __init__(self, config: EngineConfig | None = None):
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.dtype = self.config.dtype
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()

    # ---- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError before the first one if it is bad."""
        if not self.is_running:
            raise RuntimeError("the engine is not running")
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        req = await asyncio.to_thread(self.engine.make_request, prompt, params, rid)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        self._post(("add", req))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self.last_step_time = time.monotonic()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the server
                logger.exception("engine step failed")
                outputs = self.engine.fail_all(f"{type(exc).__name__}: {exc}")
            self.last_step_time = time.monotonic()
            self._deliver(outputs)
        self._deliver(self.engine.fail_all("the server is shutting down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(item)
            elif (out := self.engine.abort(item)) is not None:
                self._deliver([out])

    def _add(self, req: Request) -> None:
        if req.request_id not in self._streams:  # the caller went away before it started
            return
        try:
            self.engine.add(req)
        except ValueError as exc:
            out = RequestOutput(req.request_id, [], True, "error", error=str(exc))
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, out)
