"""A tensor-parallel worker: every rank but 0, one process each, with no scheduler.

It joins the group, loads its share of the model, builds its own ``ModelRunner`` (its KV
pool, the block count agreed with the other ranks; its CUDA graphs), then runs each step rank
0 sends (``step_channel``): the same forward over its shard, its part of every collective;
it samples nothing. Started by rank 0 with multiprocessing's "spawn" (``run_spawned``), or by
torchrun (``serve``, from the CLI on every rank but 0).

Faults: any exception ends the process with status 1, its text left in the store for rank 0's
watchdog to report (a rank that cannot run a step cannot be brought back in step with the
others). A spawned worker exits as soon as its parent, rank 0, dies (``_exit_with_parent``): no
orphan keeps a GPU's memory.
"""

from __future__ import annotations

import copy
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from flashserve.config import EngineConfig
from flashserve.engine.parallel import KEY_PREFIX, TIMEOUT, TPGroup, rank_device
from flashserve.engine.step_channel import StepReceiver

logger = logging.getLogger(__name__)
CHANNEL_KEY = KEY_PREFIX + "step_channel"  # rank 0's step channel address


def joined_key(rank: int) -> str:
    return f"{KEY_PREFIX}joined/{rank}"  # set before the rank joins the group


def loaded_key(rank: int) -> str:
    return f"{KEY_PREFIX}loaded/{rank}"  # set once its share of the model is loaded


def failed_key(rank: int) -> str:
    return f"{KEY_PREFIX}failed/{rank}"  # why it stopped, when it failed


@dataclass(frozen=True)
class SpawnArgs:
    """What a spawned worker needs: rank 0's resolved config, its rank, the store."""

    config: EngineConfig
    rank: int
    store_host: str
    store_port: int
    log_level: int


def run_spawned(args: SpawnArgs) -> None:
    """The entry point of a worker that rank 0 spawned."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # a Ctrl-C reaches the whole process group:
        signal.signal(sig, signal.SIG_IGN)  # rank 0 decides when the workers stop
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    _exit_with_parent()
    size = args.config.tensor_parallel_size
    store = dist.TCPStore(args.store_host, args.store_port, size, is_master=False,
                          timeout=TIMEOUT)  # fmt: skip
    serve(args.config, args.rank, args.rank, store)


def serve(config: EngineConfig, rank: int, local_rank: int, store: dist.Store) -> None:
    """Be rank ``rank`` (``local_rank`` on this host) until rank 0 says stop: status 0; any
    failure ends the process with status 1, its reason in the store."""
    try:
        config = copy.copy(config)  # the same engine, on this rank's device
        config.device = rank_device(config.device, local_rank)
        _limit_threads(config)
        store.set(joined_key(rank), "1")
        group = TPGroup.join(store, rank, config.tensor_parallel_size, config.device,
                             config.tp_all_reduce)  # fmt: skip
        runner = _load(config, group, store)
        channel = StepReceiver(store.get(CHANNEL_KEY).decode())
        logger.info("tensor-parallel worker rank %d ready", rank)
        while (plan := channel.recv()) is not None:
            runner.follow(plan)
        channel.close()
        runner.close()  # its CUDA graphs, before NCCL's teardown (which waits for them)
        group.destroy()
    except BaseException as exc:
        _fail(store, rank, exc)
    logger.info("tensor-parallel worker rank %d stopped", rank)


def _load(config: EngineConfig, group: TPGroup, store: dist.Store):
    """This rank's share of the model and its runner (whose start-up collectives, the KV
    pool's size and the CUDA graphs' capture, run in step with rank 0's)."""
    from flashserve.engine.model_runner import ModelRunner
    from flashserve.loaders.load import load_model

    loaded = load_model(config.model, config.device, config.torch_dtype, config.attention_backend,
                        config.seed, pdl_chain=config.pdl_chain,
                        prefill_path=config.prefill_path,
                        quantization=config.quantization, tp=group)  # fmt: skip
    store.set(loaded_key(group.rank), "1")
    return ModelRunner(config, loaded.model, loaded.config)


def _fail(store: dist.Store, rank: int, exc: BaseException) -> None:
    logger.exception("tensor-parallel worker rank %d failed", rank)
    try:
        store.set(failed_key(rank), f"{type(exc).__name__}: {exc}")
    except Exception:  # rank 0 (the store's host) is gone too
        pass
    logging.shutdown()
    os._exit(1)  # not SystemExit: a collective's threads must not hold the process up


def _limit_threads(config: EngineConfig) -> None:
    """Torch's intra-op threads: one on a GPU (as the engine core; the host's work there is
    small), the CPU's cores shared among the ranks on a CPU (each rank's matmuls are the
    work). OMP_NUM_THREADS, when set, decides instead."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    if config.is_cuda:
        torch.set_num_threads(1)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tensor_parallel_size))


def _exit_with_parent() -> None:
    """Exit as soon as rank 0's process ends, however it ends (SIGKILL included)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("rank 0 died: the tensor-parallel worker exits")
        os._exit(1)

    threading.Thread(target=watch, name="flashserve-tp-parent-watch", daemon=True).start()


def serve_torchrun(config: EngineConfig) -> int:
    """A rank > 0 that torchrun started (``flashserve serve|generate|bench decode`` on every
    rank): serve rank 0's steps until it stops; the exit status."""
    from flashserve.engine.parallel import torchrun_env

    env = torchrun_env()
    store, rank, _ = next(dist.rendezvous("env://", env.rank, env.world_size,
                                          timeout=datetime.timedelta(minutes=30)))  # fmt: skip
    serve(config, rank, env.local_rank, store)
    return 0
