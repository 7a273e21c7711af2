"""The engine core process: the ``LLMEngine`` loop, apart from the HTTP front end.

``run_core`` is the process's entry point (``EngineCoreClient`` starts it with multiprocessing's
"spawn": CUDA cannot be used in a forked child). It loads the model, tells the front end over
a pipe that it is ready (or why it cannot be), then runs ``EngineCore``: take the requests and
aborts that arrived without waiting while there is work, step, and send one message per step
with every request's new outputs and a stats snapshot. Its loop never waits on the front end:
a ZeroMQ send only queues the message (libzmq's own thread writes it, without the GIL).

Detokenizing and stop strings stay here, inside ``LLMEngine``: they cost 2.5 to 10 us per
token against a 6-7 ms decode step (docs/benchmarks/ipc.md), and with async scheduling that
host work overlaps the GPU's.

Lifetime: the core ignores SIGINT and SIGTERM (a Ctrl-C or a service manager's SIGTERM reaches
the whole process group; the front end drains, then tells the core to stop with ``Shutdown``),
and exits on its own within a second of its front end's death (``_exit_with_parent``), so that
no orphan keeps the GPU's memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass

import zmq

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import EngineDeadError, LLMEngine
from flashserve.engine.messages import (
    STATS_PERIOD_S,
    Abort,
    AddRequest,
    Codec,
    EngineStats,
    Fail,
    Shutdown,
    StepMessage,
    to_wire,
)
from flashserve.engine.outputs import RequestOutput
from flashserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
STEP_FAILED = "the engine failed a step; the server log has the details"
SHUTTING_DOWN = "the server is shutting down"
# ms a closing socket keeps trying to deliver its last messages (the final errors)
LINGER_MS = 2000


@dataclass
class CoreInfo:
    """What the front end learns from the core once the model is loaded (sent once, pickled)."""

    config: EngineConfig  # resolved: "auto" values filled in
    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    kv_cache_tokens: int  # the KV pool's size (in config.kv_cache_dtype)
    kv_cache_bytes: int


@dataclass
class CoreAddresses:
    """The ZeroMQ endpoints (``ipc://`` paths in ``directory``, which the front end made)."""

    directory: str
    to_core: str
    from_core: str


def run_core(
    config: EngineConfig,
    addresses: CoreAddresses,
    ready: multiprocessing.connection.Connection,
    log_level: int,
) -> None:
    """The core process: load, report readiness on ``ready``, serve until told to stop."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    _exit_with_parent(addresses.directory)
    _limit_torch_threads(config)
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # the front end prints it and exits, as before the split
        ready.send(("error", str(exc)))
        if not isinstance(exc, (OSError, ValueError)):  # not a bad --model: a bug, log it all
            logger.exception("the engine core could not load the model")
        raise SystemExit(1) from None
    info = CoreInfo(engine.config, engine.model_name, engine.max_model_len,
                    engine.model_config.vocab_size, engine.tokenizer,
                    engine.runner.num_kv_tokens, engine.runner.kv_cache_bytes)  # fmt: skip
    core = EngineCore(engine, addresses)
    ready.send(("ready", info))
    ready.close()
    logger.info("engine core ready (pid %d)", os.getpid())
    core.run()


def _limit_torch_threads(config: EngineConfig) -> None:
    """On a GPU, one intra-op thread for torch unless OMP_NUM_THREADS (which torch reads) says
    how many, as vLLM does in its worker processes: the host's torch work there is small
    tensors, where more threads only contend with the front end (on the 2-vCPU build machine
    under load, torch's default made this loop 15x slower: dummy:tiny at 25-36 ms a token
    instead of 1.7). On a CPU the model's matmuls are the work and want every core: with one
    thread the default model took 6.9 s to its first token of an 1,800-token prompt over HTTP
    against 3.9 s with two (2-vCPU machine, otherwise idle; transformers: 3.4 s)."""
    if config.is_cuda and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def _exit_with_parent(directory: str) -> None:
    """Exit as soon as the front end dies, however it dies (SIGKILL included): a thread waits
    on the parent's sentinel, which becomes readable when the parent process ends. It removes
    the sockets' directory, which the dead front end cannot, and ends the process at once."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("the front end process died: the engine core exits")
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="flashserve-parent-watch", daemon=True).start()


class EngineCore:
    """The engine loop, fed by a ZeroMQ PULL socket and publishing on a PUSH socket."""

    def __init__(self, engine: LLMEngine, addresses: CoreAddresses) -> None:
        self.engine = engine
        self.codec = Codec()
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.connect(addresses.to_core)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never blocks the loop
        self.outbox.connect(addresses.from_core)
        self._sent: dict[str, int] = {}  # characters of each open request's text sent
        self._refusal: str | None = None  # set by Fail: every request fails with it
        self._stop = False
        self._last_publish = 0.0
        self._memory: tuple[int, int] | None = None
        self._memory_time = 0.0

    def run(self) -> None:
        try:
            self._publish([])  # the first snapshot: /metrics has gauges from the start
            self._loop()
            self._publish(self.engine.fail_all(SHUTTING_DOWN))
        finally:
            self.engine.close()
            self.inbox.close(linger=0)
            self.outbox.close(linger=LINGER_MS)
            self.ctx.term()

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            engine.check_alive()  # a dead tensor-parallel rank ends the core, idle too
            outputs = self._drain(wait=not engine.has_unfinished())
            if engine.has_unfinished() and not self._stop:
                try:
                    outputs += engine.step()
                except EngineDeadError:
                    raise  # the device is gone: the process ends, the front end sees it
                except Exception:  # not a request's fault (the step isolates those)
                    logger.exception("engine step failed")
                    outputs += engine.fail_all(STEP_FAILED)
            if outputs or time.monotonic() - self._last_publish >= STATS_PERIOD_S:
                self._publish(outputs)

    # ---- requests in ---------------------------------------------------------------------

    def _drain(self, wait: bool) -> list[RequestOutput]:
        """Handle every message that has arrived; with ``wait`` (idle), first wait for one up
        to the stats period. Returns the outputs they produced (refusals, aborts)."""
        outputs: list[RequestOutput] = []
        if wait and not self.inbox.poll(STATS_PERIOD_S * 1000):
            return outputs
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            self._handle(self.codec.to_core.decode(frame), outputs)

    def _handle(self, msg, outputs: list[RequestOutput]) -> None:
        engine = self.engine
        if isinstance(msg, AddRequest):
            outputs.extend(self._add(msg))
        elif isinstance(msg, Abort):
            for rid in msg.request_ids:
                if (out := engine.abort(rid)) is not None:
                    outputs.append(out)
        elif isinstance(msg, Fail):
            self._refusal = msg.error
            outputs.extend(engine.fail_all(msg.error))
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _add(self, msg: AddRequest) -> list[RequestOutput]:
        rid = msg.request_id
        if self._refusal is not None:
            return [RequestOutput(rid, [], True, "error", error=self._refusal)]
        try:  # the front end checked the prompt; the engine checks the ids again, O(length)
            self.engine.add(self.engine.make_request(msg.prompt_token_ids, msg.params, rid))
        except ValueError as exc:
            return [RequestOutput(rid, [], True, "error", error=str(exc))]
        return []

    # ---- outputs out ---------------------------------------------------------------------

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """One message: ``outputs`` and the stats after them."""
        wire = []
        for out in outputs:
            wire.append(to_wire(out, self._sent.get(out.request_id, 0)))
            if out.finished:
                self._sent.pop(out.request_id, None)
            else:
                self._sent[out.request_id] = len(out.generated_text)
        self.outbox.send(self.codec.encode(StepMessage(wire, self._stats())))

    def _stats(self) -> EngineStats:
        now = self._last_publish = time.monotonic()
        return self.engine.stats(now, self._device_memory(now))

    def _device_memory(self, now: float) -> tuple[int, int] | None:
        """(allocated, reserved) bytes on the engine's CUDA device, read at most once per
        stats period (a gauge needs no more, and the loop saves the two driver calls)."""
        config = self.engine.config
        if not config.is_cuda:
            return None
        if now - self._memory_time >= STATS_PERIOD_S:
            import torch

            device = torch.device(config.device)
            self._memory = (torch.cuda.memory_allocated(device),
                            torch.cuda.memory_reserved(device))  # fmt: skip
            self._memory_time = now
        return self._memory
