"""``EngineCoreClient``: an ``EngineClient`` whose engine runs in a process of its own.

The HTTP front end keeps what it needs anyway (the tokenizer, for chat templates, truncation
and the length checks; the prompt checks themselves) and sends the core token ids. The core
(``flashserve.engine.core``) answers with one message per step; a reader task on the front
end's event loop hands each output to its request's queue, and keeps the latest stats
snapshot for ``/metrics`` and the heartbeat for ``/health``.

Faults: the core's death (an exception in its loop, a signal, the OOM killer) is seen at once
through its process sentinel: every open request ends with an error output, ``is_running``
turns False and ``stalled_reason`` says why (``/health`` 503; the server then exits 1 after
``--dead-exit-delay``). A core that stops publishing while requests are pending is stalled
after ``stall_timeout``, as the engine thread is in process.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import zmq
import zmq.asyncio

from flashserve.config import EngineConfig
from flashserve.engine.core import CoreAddresses, CoreInfo, run_core
from flashserve.engine.messages import (
    Abort,
    AddRequest,
    Codec,
    EngineStats,
    Fail,
    Shutdown,
    StepMessage,
    ToCore,
    from_wire,
)
from flashserve.engine.outputs import RequestOutput
from flashserve.engine.prompts import PromptChecker
from flashserve.engine.protocol import RequestStats, new_request_id, relay
from flashserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)
# seconds the core gets to fail its requests and exit after Shutdown before it is killed
STOP_TIMEOUT_S = 30.0


class CoreStartupError(RuntimeError):
    """The core process could not load the model (the message says why) or died first."""


@dataclass
class _Open:
    """A request in flight: its output queue, its prompt, its generated text so far."""

    queue: asyncio.Queue
    prompt_token_ids: list[int]
    text: str = ""
    finished: bool = False


class EngineCoreClient:
    """Starts the engine core process (loading the model there) and talks to it.

    The constructor blocks until the model is loaded, and raises ``CoreStartupError`` with the
    core's reason when it cannot be. ``start()`` must then be called on the event loop that
    will call ``generate``."""

    def __init__(self, config: EngineConfig | None = None, log_level: int | None = None) -> None:
        config = config or EngineConfig()
        self._dir = tempfile.mkdtemp(prefix="flashserve-core-")
        addresses = CoreAddresses(self._dir, f"ipc://{self._dir}/to-core",
                                  f"ipc://{self._dir}/from-core")  # fmt: skip
        self._codec = Codec()
        self._zmq = zmq.Context()
        self._outbox = self._zmq.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.SNDHWM, 0)  # sends queue, never block the event loop
        self._outbox.bind(addresses.to_core)
        self._inbox = self._zmq.socket(zmq.PULL)
        self._inbox.bind(addresses.from_core)
        self._send_lock = threading.Lock()  # a socket is not thread-safe: shutdown runs apart
        self._reading: zmq.asyncio.Socket | None = None  # the inbox, on the event loop
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=False)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        self._proc = ctx.Process(target=run_core, args=(config, addresses, theirs, level),
                                 name="flashserve-engine-core")  # fmt: skip
        # the shutdown thread and the event loop both look at the process: two waitpid calls
        # at once leave one without the status (multiprocessing then says None), so every
        # look goes through _exitcode, under this lock
        self._proc_lock = threading.Lock()
        self._proc.start()
        theirs.close()
        atexit.register(self._kill)  # whatever happens to this process, no core outlives it
        try:
            info = self._wait_ready(ours)
        except BaseException:
            self._kill()
            self._inbox.close(linger=0)
            self._outbox.close(linger=0)
            raise
        finally:
            ours.close()
        self.config: EngineConfig = info.config
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.kv_cache_tokens = info.kv_cache_tokens
        self.kv_cache_bytes = info.kv_cache_bytes
        self.prompts = PromptChecker(info.tokenizer, info.vocab_size, info.max_model_len)
        self.on_finished: list[Callable[[RequestStats], None]] = []
        self._streams: dict[str, _Open] = {}
        self._stats: EngineStats | None = None
        self._heartbeat = time.monotonic()
        self._started = False
        self._stopping = False
        self._dead: str | None = None  # why the core is gone, once it is
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None

    def _wait_ready(self, conn: multiprocessing.connection.Connection) -> CoreInfo:
        """The core's ``CoreInfo``, once it has loaded the model; CoreStartupError if it says
        it cannot, or dies first."""
        died = "the engine core process exited with status {} while loading the model"
        while not conn.poll(0.1):
            if (code := self._exitcode()) is not None:
                raise CoreStartupError(died.format(code))
        try:
            kind, *rest = conn.recv()
        except EOFError:
            raise CoreStartupError(died.format(self._wait_exit(5))) from None
        if kind == "error":
            raise CoreStartupError(rest[0])
        return rest[0]

    # ---- lifetime ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._proc.sentinel, self._on_core_exit)
        self._reading = zmq.asyncio.Socket.from_socket(self._inbox)
        self._reader = self._loop.create_task(self._read(), name="flashserve-core-reader")

    def shutdown(self) -> None:
        """Tell the core to stop (it fails what is still open), wait for it, clean up. Safe
        from any thread, and more than once."""
        if self._stopping:
            return
        self._stopping = True
        if self._exitcode() is None:
            self._send(Shutdown())
            self._wait_exit(STOP_TIMEOUT_S)
        self._kill()
        logger.info("the engine core stopped with status %s", self._exitcode())
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_reading)

    def _stop_reading(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._loop.remove_reader(self._proc.sentinel)
        (self._reading or self._inbox).close(linger=0)
        with self._send_lock:
            self._outbox.close(linger=0)

    def _kill(self) -> None:
        """End the core now if it still runs, and remove the sockets' directory."""
        if self._proc.pid is not None and self._exitcode() is None:
            with self._proc_lock:
                self._proc.kill()
            self._wait_exit(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _exitcode(self) -> int | None:
        """The core's exit status (negative: the signal), None while it runs."""
        with self._proc_lock:
            return self._proc.exitcode

    def _wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the core to exit; its status, None if it still runs."""
        if multiprocessing.connection.wait([self._proc.sentinel], timeout):
            # the sentinel closes as the process exits, a moment before it can be reaped
            with self._proc_lock:
                self._proc.join()
        return self._exitcode()

    @property
    def is_running(self) -> bool:
        return (self._started and not self._stopping and self._dead is None
                and self._exitcode() is None)  # fmt: skip

    def stalled_reason(self, stall_timeout: float) -> str | None:
        """Why the engine is dead, or None while it makes progress: the core process is gone,
        or requests are pending and its last message is older than ``stall_timeout`` s."""
        if self._dead is not None:
            return self._dead
        if self._exitcode() is not None:
            return self._exit_reason()
        if not self._started or self._stopping:
            return "the engine is not running"
        stats = self._stats
        busy = bool(self._streams) or (stats is not None and stats.unfinished > 0)
        age = time.monotonic() - self._heartbeat
        if busy and age > stall_timeout:
            return f"the engine loop made no progress for {age:.0f} s"
        return None

    def stats(self) -> EngineStats | None:
        return self._stats

    def check_text_fits(self, text: str) -> None:
        self.prompts.check_text_fits(text)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; raises ValueError before the first one if it is bad."""
        rid = new_request_id(self.is_running, self._streams, request_id)
        arrival = time.monotonic()
        ids = await asyncio.to_thread(self.prompts.checked_ids, prompt, params)
        state = _Open(asyncio.Queue(), ids)
        self._streams[rid] = state
        stats = RequestStats(arrival, num_prompt_tokens=len(ids))
        if self._dead is None:
            self._send(AddRequest(rid, ids, params))
        else:  # the core died while the prompt was checked: an error, as for those it held
            self._fail(rid, state)
        relayed = relay(state.queue, stats, self.on_finished, self._streams, rid, self.abort)
        async with aclosing(relayed) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        self._send(Abort([request_id]))

    def fail_requests(self, error: str) -> None:
        self._send(Fail(error))

    def _send(self, message: ToCore) -> None:
        if self._dead is not None:
            return
        frame = self._codec.encode(message)
        with self._send_lock:
            if self._outbox.closed:
                return
            self._outbox.send(frame)  # only queues it (no high-water mark: never blocks)

    # ---- outputs in --------------------------------------------------------------------------

    async def _read(self) -> None:
        """Hand each message's outputs to their requests, keep its stats: until cancelled."""
        decode = self._codec.step.decode
        while True:
            frame = await self._reading.recv()
            self._dispatch(decode(frame), time.monotonic())

    def _dispatch(self, msg: StepMessage, now: float) -> None:
        self._stats = msg.stats
        self._heartbeat = now
        for w in msg.outputs:
            state = self._streams.get(w.request_id)
            if state is None or state.finished:
                continue  # its caller went away
            state.text = w.text if w.finished else state.text + w.text
            state.finished = w.finished
            state.queue.put_nowait((now, from_wire(w, state.text, state.prompt_token_ids)))

    def _on_core_exit(self) -> None:
        """The core process ended (its sentinel is readable): if it was not told to, every
        open request ends with an error and the engine counts as dead."""
        self._loop.remove_reader(self._proc.sentinel)
        self._wait_exit(1)
        if self._stopping:
            return
        self._dead = self._exit_reason()
        logger.error("%s: failing %d open request(s)", self._dead, len(self._streams))
        for rid, state in list(self._streams.items()):
            self._fail(rid, state)

    def _fail(self, rid: str, state: _Open) -> None:
        """End an open request with the error of the core's death."""
        if not state.finished:
            state.finished = True
            out = RequestOutput(rid, [], True, "error", error=f"the engine stopped: {self._dead}")
            state.queue.put_nowait((time.monotonic(), out))

    def _exit_reason(self) -> str:
        code = self._exitcode()
        how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
        return f"the engine core process died ({how})"
