"""The engine on its own thread, with an async token stream per request.

The engine thread owns the ``LLMEngine``: it drains an inbox of new requests and aborts, runs
steps while there is work, and hands each output to the asyncio loop of the request that waits
for it. Callers never touch engine state directly.

It is the in-process ``EngineClient`` (``flashserve.engine.protocol``): the Python API, and the
engine of ``build_app(config)`` and of the tests that reach the engine behind a server.
``flashserve serve`` runs the engine in a process of its own instead (``EngineCoreClient``),
so that the HTTP front end's Python never competes with the engine loop for one GIL.

For health checks and metrics it keeps a heartbeat (the engine thread stamps it on every loop
iteration, idle waits included), reports each request's timings (``RequestStats``) to the
callbacks in ``on_finished``, on the request's own event loop, and gives its gauges as a stats
snapshot (``stats``), the memory of its device included.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import torch

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import EngineDeadError, LLMEngine, Request
from flashserve.engine.messages import EngineStats
from flashserve.engine.outputs import RequestOutput
from flashserve.engine.protocol import RequestStats, new_request_id, relay
from flashserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
STEP_FAILED = "the engine failed a step; the server log has the details"


class AsyncLLM:
    """``generate()`` yields a ``RequestOutput`` per new token; closing it early aborts.

    An ``EngineClient`` (``flashserve.engine.protocol``): what ``build_app(llm=...)`` serves."""

    def __init__(self, config: EngineConfig | None = None):
        self.engine = LLMEngine(config)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.kv_cache_tokens = self.engine.runner.num_kv_tokens
        self.kv_cache_bytes = self.engine.runner.kv_cache_bytes
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self._refusal: str | None = None  # set by fail_requests: every request fails with it
        self.last_step_time = time.monotonic()  # the heartbeat
        self.on_finished: list[Callable[[RequestStats], None]] = []

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
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stalled_reason(self, stall_timeout: float) -> str | None:
        """Why the engine is dead, or None while it makes progress: the watchdog's verdict.

        Dead means the thread is gone, or work is pending and the heartbeat is older than
        ``stall_timeout`` seconds (one step that long counts as a hang)."""
        if not self.is_running:
            return "the engine is not running"
        busy = self.engine.has_unfinished() or not self._inbox.empty()
        age = time.monotonic() - self.last_step_time
        if busy and age > stall_timeout:
            return f"the engine loop made no progress for {age:.0f} s"
        return None

    def device_memory(self) -> tuple[int, int] | None:
        """(allocated, reserved) bytes of torch's caching allocator on the engine's CUDA
        device; None on a CPU. Safe from any thread: it reads the allocator's counters."""
        if not self.config.is_cuda:
            return None
        device = torch.device(self.config.device)
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    def stats(self) -> EngineStats:
        """The engine's gauges now: plain ints and floats that the engine thread writes,
        safe to read from any thread (never mutate)."""
        return self.engine.stats(self.last_step_time, self.device_memory())

    def check_text_fits(self, text: str) -> None:
        self.engine.check_text_fits(text)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError before the first one if it is bad."""
        rid = new_request_id(self.is_running, self._streams, request_id)
        arrival = time.monotonic()
        req = await asyncio.to_thread(self.engine.make_request, prompt, params, rid)
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        stats = RequestStats(arrival, num_prompt_tokens=req.seq.num_prompt_tokens)
        self._post(("add", req))
        relayed = relay(stream, stats, self.on_finished, self._streams, rid, self.abort)
        async with aclosing(relayed) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def fail_requests(self, error: str) -> None:
        """End every open request with an error output saying ``error``, and every request
        added later too: for a shutdown that cannot wait any longer, so that each stream ends
        with its error event. The engine thread does it, through the inbox."""
        self._post(("fail", error))

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # the thread dies: health checks see it, log why
            self.error = exc
            logger.exception("the engine thread died")
            self._fail_streams(f"the engine stopped: {type(exc).__name__}: {exc}")
            raise

    def _fail_streams(self, error: str) -> None:
        """End every open stream with an error, so that no caller waits for a dead thread."""
        self._deliver([RequestOutput(rid, [], True, "error", error=error)
                       for rid in list(self._streams)])  # fmt: skip

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.engine.check_alive()  # a dead tensor-parallel rank ends the thread, idle too
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                self.last_step_time = time.monotonic()
                continue
            try:
                outputs = self.engine.step()
            except EngineDeadError:
                raise  # the device is gone: the thread dies, /health says so, a restart helps
            except Exception:  # not a request's fault (the step isolates those): fail them all
                logger.exception("engine step failed")
                outputs = self.engine.fail_all(STEP_FAILED)
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
            elif kind == "fail":
                self._refusal = item
                self._deliver(self.engine.fail_all(item))
            elif (out := self.engine.abort(item)) is not None:
                self._deliver([out])

    def _add(self, req: Request) -> None:
        if req.request_id not in self._streams:  # the caller went away before it started
            return
        if self._refusal is not None:
            self._deliver([RequestOutput(req.request_id, [], True, "error", error=self._refusal)])
            return
        try:
            self.engine.add(req)
        except ValueError as exc:
            out = RequestOutput(req.request_id, [], True, "error", error=str(exc))
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, stream = target
                loop.call_soon_threadsafe(stream.put_nowait, (now, out))
