"""Rank 0's side of tensor parallelism: its workers, the watchdog over them, the step channel.

The engine's own process is rank 0: it runs the scheduler once, sends each step's plan to the
workers (``step_channel``) and samples from the gathered logits. ``TPWorkers.start`` starts
ranks 1..N-1 with multiprocessing's "spawn" (CUDA cannot be used in a forked child), each on
its own device, and meets them through a TCP store on localhost (a free port); under torchrun
the other ranks are torchrun's processes, met through its ``env://`` variables.

Start-up, in step with ``tp_worker.serve``: the workers join the group; every rank loads its
share; rank 0 waits until each worker has loaded (``wait_loaded``: a worker's load error
becomes rank 0's, in one line), then the runners' collectives run (the KV pool's block count,
the CUDA graphs' capture), then every worker subscribes to the step channel (``wait_ready``).

Faults: a watchdog thread waits on the workers' process sentinels. When one dies, the engine
is dead (``check_alive`` raises ``EngineDeadError``, with the worker's own error when it left
one): on the CPU a gloo collective with the dead rank fails at once, so the step in flight
raises too; on CUDA an NCCL collective with a dead rank never returns and cannot be
interrupted, so after ``CUDA_DEAD_EXIT_S`` the watchdog ends the process (status 1), which the
server's front end reports as the engine core's death. Rank 0's death ends the workers
(``tp_worker._exit_with_parent``).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time

import torch.distributed as dist

from flashserve.config import EngineConfig
from flashserve.engine.errors import EngineDeadError
from flashserve.engine.parallel import TIMEOUT, TPGroup, rank_device, torchrun_env
from flashserve.engine.step_channel import StepSender
from flashserve.engine.step_plan import StepPlan
from flashserve.engine.tp_worker import (
    CHANNEL_KEY,
    SpawnArgs,
    failed_key,
    joined_key,
    loaded_key,
    run_spawned,
)

logger = logging.getLogger(__name__)
CUDA_DEAD_EXIT_S = 3.0  # after a worker's death on CUDA: rank 0's process ends (see above)
JOIN_TIMEOUT_S = 300.0  # to start a worker (import torch, read the config) and meet it
STOP_TIMEOUT_S = 30.0  # for a worker to stop when told, before it is killed


class TPWorkers:
    """Ranks 1..N-1 as rank 0 sees them. ``group`` is rank 0's ``TPGroup``."""

    def __init__(self, config: EngineConfig, store: dist.Store, sender: StepSender,
                 procs: dict[int, multiprocessing.Process]) -> None:  # fmt: skip
        self.config = config
        self.size = config.tensor_parallel_size
        self.store = store
        self.sender = sender
        self.procs = procs  # rank -> process; empty under torchrun
        self.group: TPGroup | None = None
        self.dead: str | None = None  # why the group cannot go on, once it cannot
        self._died = threading.Event()
        self._ready = False  # every worker listens to the step channel
        self._polling = True  # rank 0 meets the workers only through polls (until loaded)
        self._closing = False
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)

    @classmethod
    def start(cls, config: EngineConfig, log_level: int | None = None) -> TPWorkers:
        """Start the workers (or, under torchrun, meet torchrun's) and join the group with
        them; a worker that dies first is a RuntimeError naming its error."""
        env = torchrun_env()
        if env is not None:
            return cls._meet_torchrun(config, env)
        size = config.tensor_parallel_size
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=TIMEOUT)  # fmt: skip
        sender = StepSender("127.0.0.1", "127.0.0.1")
        store.set(CHANNEL_KEY, sender.address)
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        ctx = multiprocessing.get_context("spawn")
        procs = {}
        for rank in range(1, size):
            args = SpawnArgs(config, rank, "127.0.0.1", store.port, level)
            procs[rank] = ctx.Process(target=run_spawned, args=(args,),
                                      name=f"flashserve-tp-rank-{rank}")  # fmt: skip
            procs[rank].start()
        workers = cls(config, store, sender, procs)
        atexit.register(workers.close)  # whatever happens to rank 0, its workers stop
        try:
            workers._wait_keys([joined_key(r) for r in procs], "start", JOIN_TIMEOUT_S)
            workers.group = TPGroup.join(store, 0, size, rank_device(config.device, 0),
                                         config.tp_all_reduce)  # fmt: skip
        except BaseException:
            workers.close()
            raise
        threading.Thread(target=workers._watch, name="flashserve-tp-watchdog",
                         daemon=True).start()  # fmt: skip
        return workers

    @classmethod
    def _meet_torchrun(cls, config: EngineConfig, env) -> TPWorkers:
        if env.rank != 0 or env.world_size != config.tensor_parallel_size:
            raise ValueError(f"under torchrun the engine is rank 0 of --tensor-parallel-size "
                             f"({config.tensor_parallel_size}) ranks; this process is rank "
                             f"{env.rank} of {env.world_size}")  # fmt: skip
        store, _, _ = next(dist.rendezvous("env://", 0, env.world_size, timeout=TIMEOUT))
        sender = StepSender("*", os.environ.get("MASTER_ADDR", "127.0.0.1"))
        store.set(CHANNEL_KEY, sender.address)
        workers = cls(config, store, sender, {})
        atexit.register(workers.close)
        workers.group = TPGroup.join(store, 0, env.world_size,
                                     rank_device(config.device, env.local_rank),
                                     config.tp_all_reduce)  # fmt: skip
        return workers

    # ---- start-up ----------------------------------------------------------------------------

    def wait_loaded(self) -> None:
        """Until every worker has loaded its share of the model (call after rank 0 has):
        ValueError or RuntimeError with a worker's error if one could not."""
        ranks = range(1, self.size)
        self._wait_keys([loaded_key(r) for r in ranks], "load its share of the model",
                        TIMEOUT.total_seconds())  # fmt: skip
        self._polling = False  # collectives from here on

    def wait_ready(self) -> None:
        """Until every worker listens to the step channel."""
        self.sender.wait_for(self.size - 1, self._check_started, JOIN_TIMEOUT_S)
        self._ready = True

    def _wait_keys(self, keys: list[str], what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
            self._check_started()
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not {what} in {timeout:.0f} s")
            time.sleep(0.05)

    def _check_started(self) -> None:
        """Raise if a worker is gone: ValueError when its error was a bad model or file (the
        same as rank 0's would be), RuntimeError otherwise."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                error = self._error_of(rank) or f"exited with status {proc.exitcode}"
                kind = error.split(":", 1)[0]
                cls = ValueError if kind in _MODEL_ERRORS else RuntimeError
                raise cls(f"tensor-parallel worker rank {rank} failed: {error}")

    # ---- serving -----------------------------------------------------------------------------

    def send(self, plan: StepPlan) -> None:
        """Hand a step's plan to every worker (queued: returns at once)."""
        self.sender.send(plan)

    def check_alive(self) -> None:
        """EngineDeadError once a worker has died."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def dead_reason(self, wait: float) -> str | None:
        """Why the group is dead, waiting up to ``wait`` s for the watchdog to see a death."""
        self._died.wait(wait if self.procs else 0)
        return self.dead

    def _watch(self) -> None:
        """Wait for a worker's death (or ``close``), then declare the group dead."""
        sentinels = {proc.sentinel: rank for rank, proc in self.procs.items()}
        ready = multiprocessing.connection.wait([*sentinels, self._wake_r])
        if self._closing:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)
        proc = self.procs[rank]
        proc.join(1)
        code = proc.exitcode
        how = f"signal {-code}" if code is not None and code < 0 else f"status {code}"
        error = self._error_of(rank)
        self.dead = f"tensor-parallel worker rank {rank} died ({how})" + (
            f": {error}" if error else "")  # fmt: skip
        self._died.set()
        logger.error("%s: the engine cannot go on", self.dead)
        # while rank 0 still only polls for the workers (loading), the poll reports the death
        if not self._polling and self.group is not None and self.group.device.type == "cuda":
            threading.Timer(CUDA_DEAD_EXIT_S, self._exit).start()

    def _exit(self) -> None:
        """End rank 0's process: its NCCL collectives with the dead rank never return."""
        if self._closing:
            return
        logger.error("rank 0 exits: NCCL collectives with a dead rank cannot be interrupted")
        logging.shutdown()
        os._exit(1)

    def _error_of(self, rank: int) -> str | None:
        try:
            if self.store.check([failed_key(rank)]):
                return self.store.get(failed_key(rank)).decode()
        except Exception:  # the store itself failed: no message, the death still counts
            pass
        return None

    # ---- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the workers (told to, then killed after ``STOP_TIMEOUT_S``), leave the group.
        Workers that cannot be told (a rank died: the others wait in a collective that never
        completes; the start-up failed: they do not listen yet) are killed at once. Safe more
        than once, and from atexit."""
        if self._closing:
            return
        self._closing = True
        self._wake_w.send(None)
        alive = [p for p in self.procs.values() if p.is_alive()]
        graceful = self.dead is None and (self._ready or not self.procs)
        if graceful:
            self.sender.stop()
            if self.group is not None:  # while the workers leave theirs (NCCL's teardown
                self.group.destroy()  # may wait for the other ranks')
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in alive:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("tensor-parallel worker %s did not stop: killed", proc.name)
                proc.kill()
                proc.join(5)
        self.sender.close()
        # the workers are gone: gloo's group can go; NCCL's teardown might wait for them
        if not graceful and self.group is not None and self.group.device.type != "cuda":
            self.group.destroy()
        atexit.unregister(self.close)


_MODEL_ERRORS = ("ValueError", "OSError", "FileNotFoundError", "WeightsError")
