"""The tensor-parallel process group: how the ranks meet, and the collectives they call.

Every rank is one process with one device: ``cuda:<first + local rank>`` on CUDA (NCCL), or
the CPU (gloo). The ranks meet through torch.distributed's own rendezvous: a TCP store that
rank 0 hosts on localhost when the engine starts its workers itself
(``flashserve.engine.tp_workers``), or, under ``torchrun`` (one process per GPU, on one host or
several), the ``env://`` variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): ``torchrun_env`` is the one place that reads them.

``TPGroup`` is the ``sharding.TPComm`` the model calls (the all-reduce after the row-parallel
layers and the embeddings, the gather of the logits) plus what the runner needs: the KV pool's
block count agreed as the ranks' minimum, and a look-ahead step's input tokens broadcast from
rank 0. Collectives time out after ``TIMEOUT`` (a rank that is alive but stuck).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Collectives wait at most this long: the first one follows each rank's loading of its shard,
# so a rank that loads more slowly than the others keeps them waiting there. A rank that dies
# is noticed at once instead (tp_workers' watchdog, and gloo's closed connections).
TIMEOUT = datetime.timedelta(minutes=10)
KEY_PREFIX = "flashserve/"  # our keys in the store (torchrun's agent keeps its own there)


@dataclass(frozen=True)
class TorchrunEnv:
    """A process that torchrun started: its global and local rank, and the group's size."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """The torchrun variables of this process; None when torchrun did not start it."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    env = os.environ
    return TorchrunEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank ``local_rank`` places on this host: ``cuda:<first + local
    rank>`` for ``cuda`` / ``cuda:<first>``; the CPU for every rank on a CPU."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":")[1]) if ":" in device else 0
    return f"cuda:{first + local_rank}"


def missing_gpus(device: str, size: int, available: int) -> str | None:
    """Why ``size`` ranks from ``device`` on cannot each have a GPU of the ``available``;
    None when they can (or on the CPU)."""
    if not device.startswith("cuda"):
        return None
    first = int(device.split(":")[1]) if ":" in device else 0
    if first + size <= available:
        return None
    where = f" from cuda:{first} on" if first else ""
    return (f"tensor_parallel_size {size} needs {size} GPUs{where}, one per rank; "
            f"torch sees {available}")  # fmt: skip


class TPGroup:
    """This process's rank of the tensor-parallel group (torch.distributed's default group:
    one group per process, so one tensor-parallel engine at a time)."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        self.rank = rank
        self.size = size
        self.device = device

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: str) -> TPGroup:
        """Join the group through ``store``: NCCL on CUDA (each rank bound to its device),
        gloo on the CPU. On CUDA the communicator is warmed up (a first all-reduce and
        gather), so that CUDA graphs can capture its collectives."""
        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group: "
                               "one tensor-parallel engine per process")  # fmt: skip
        dev = torch.device(device)
        kwargs = {}
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            kwargs["device_id"] = dev  # the communicator is created now, on this device
        backend = "nccl" if dev.type == "cuda" else "gloo"
        store = dist.PrefixStore(KEY_PREFIX + "pg/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=TIMEOUT, **kwargs)  # fmt: skip
        group = cls(rank, size, dev)
        group.warm_up()
        logger.info("tensor-parallel rank %d of %d on %s (%s)", rank, size, dev, backend)
        return group

    def warm_up(self) -> None:
        """One of each collective the model calls, waited for: NCCL sets up its channels on
        first use, which a CUDA graph cannot capture."""
        x = torch.ones(1, device=self.device)
        self.all_reduce(x)
        self.gather_last_dim(x)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if x.item() != self.size:
            raise RuntimeError(f"tensor-parallel warm-up: all-reduce gave {x.item()}")

    # ---- what the model calls (sharding.TPComm) ------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather (every rank gets the whole: NCCL's all-gather is captured in a CUDA
        graph as readily as an all-reduce, and the workers' copy costs the link little: the
        logits of a decode step are B x V/N floats)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    # ---- what the runner calls -------------------------------------------------------------

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x``, in place."""
        dist.broadcast(x, src=0)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
