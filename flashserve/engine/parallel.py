"""The tensor-parallel process group: how the ranks meet, and the collectives they call.

Every rank is one process with one device: ``cuda:<first + local rank>`` on CUDA (NCCL), or
the CPU (gloo). The ranks meet through torch.distributed's own rendezvous: a TCP store that
rank 0 hosts on localhost when the engine starts its workers itself
(``flashserve.engine.tp_workers``), or, under ``torchrun`` (one process per GPU, on one host or
several), the ``env://`` variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``): ``torchrun_env`` is the one place that reads them.

``TPGroup`` is the ``sharding.TPComm`` the model calls (the all-reduce after the row-parallel
layers, the gather of the logits) plus what the runner needs: the KV pool's
block count agreed as the ranks' minimum, and a look-ahead step's input tokens broadcast from
rank 0. Collectives time out after ``TIMEOUT`` (a rank that is alive but stuck).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.fold import ROWS as FOLD_ROWS
from kernels.fold import WORD_BYTES as FOLD_WORD_BYTES
from kernels.fold import AllReduceFold

logger = logging.getLogger(__name__)

# Collectives wait at most this long: the first one follows each rank's loading of its shard,
# so a rank that loads more slowly than the others keeps them waiting there. A rank that dies
# is noticed at once instead (tp_workers' watchdog, and gloo's closed connections).
TIMEOUT = datetime.timedelta(minutes=10)
KEY_PREFIX = "flashserve/"  # our keys in the store (torchrun's agent keeps its own there)
# With tp_all_reduce auto, all-reduces up to this size go through torch's symmetric-memory
# one-shot kernel (each rank reads the others' buffers over NVLink, one launch) instead of
# NCCL. Measured on two H200s (NVLink, NCCL multicast off), 2026-11-26, the 65 all-reduces of
# a Llama-3-8B decode step under a CUDA graph: NCCL 1.2 ms (its LL protocol 1.09, LL128 1.66,
# Simple 1.93), one-shot 0.41 ms, at 8 KiB and 64 KiB alike (docs/benchmarks/tensor-parallel.md);
# larger messages were not measured and stay with NCCL.
ONE_SHOT_MAX_BYTES = 64 << 10
# With tp_all_reduce fused (two ranks on one host), the all-reduces after o_proj and down_proj of
# steps of up to kernels.fold.ROWS tokens are folded into those GEMVs and the norms after them
# (kernels.fold: no collective launched); larger steps' go through NCCL. Each rank's symmetric
# buffer: two slots of this many bytes, at fixed offsets whatever the hidden size and dtype (so that
# consecutive calls never share bytes): 16 rows of up to 16,384 columns, a value and its call's tag
# in each 8-byte word.
FOLD_SLOT_BYTES = 2 << 20
CHECK_SPINS = 1 << 24  # the start-up check's norms wait at most this many reads of their row


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
        self.one_shot: _OneShot | None = None  # small all-reduces (tp_all_reduce auto)
        self.fused: _Fused | None = None  # decode steps' folded all-reduces (fused)

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: str,
             all_reduce: str = "nccl") -> TPGroup:  # fmt: skip
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
        _import_before_the_group()
        store = dist.PrefixStore(KEY_PREFIX + "pg/", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=TIMEOUT, **kwargs)  # fmt: skip
        group = cls(rank, size, dev)
        group.warm_up()
        if dev.type == "cuda":  # the ranks agree, whatever each one's reason
            group.one_shot = _OneShot.agreed(group, all_reduce)
        if all_reduce == "fused":
            group.fused = _Fused.agreed(group)
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
        if self.one_shot is None or not self.one_shot.all_reduce(x):
            dist.all_reduce(x)
        return x

    def fold_for(self, x: torch.Tensor) -> AllReduceFold | None:
        """The folded all-reduce for a step whose activations look like ``x`` [T, hidden]
        (tp_all_reduce fused, T up to ``kernels.fold.ROWS``); None: ``all_reduce`` it is.
        Every rank decides alike: the same step, the same shapes."""
        if self.fused is None or x.dim() != 2 or not 1 <= x.shape[0] <= FOLD_ROWS:
            return None
        return self.fused.fold(x.shape[1], x.dtype)

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
        """Leave the group: its threads (gloo's) end here, while Python still runs."""
        self.one_shot = None
        self.fused = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _import_before_the_group() -> None:
    """torch.distributed.nn's functions default to ``group=group.WORLD``, read when the module
    is imported. Torch imports it lazily (with torch._dynamo, in the model's load), so after
    the group exists it would hold the group past ``destroy_process_group``: gloo's threads
    then ran into the interpreter's exit, where one freeing a collective's last tensors needs
    the GIL and aborts the process ("terminate called without an active exception", SIGABRT:
    3 of 150 torchrun runs on a loaded 2-core CPU; 0 of 150 since). Imported first, the
    defaults are None."""
    import torch.distributed.nn  # noqa: F401


def one_shot_refusal(ranks_share_host: bool, used_before: bool, has_op: bool) -> str | None:
    """Why this rank (on CUDA, tp_all_reduce auto) cannot take the one-shot all-reduce; None
    when it can try. Its own reasons only: ``_OneShot.agreed`` has every rank follow a
    refusal."""
    if not ranks_share_host:
        return "the ranks span hosts"
    if used_before:
        # torch (2.11) numbers each process's symmetric-memory rendezvous with one counter for
        # all groups: a second engine's rank 0 would meet fresh workers under another number
        # and wait forever (pytorch/pytorch#196082; seen here on two H200s, 2026-11-26)
        return "this process already made a tensor-parallel group with it"
    if not has_op:
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_copy_out"
    return None


def fused_refusal(device: str, size: int, backend: str, ranks_share_host: bool) -> str | None:
    """Why tp_all_reduce fused cannot run with these settings (checked when the config is
    made, before any worker starts); None when it can be tried. ``TPGroup.join`` then sets it
    up on every rank or fails on every rank: it is never swapped for NCCL silently."""
    if not device.startswith("cuda"):
        return "tp_all_reduce fused needs CUDA GPUs (each rank stores into the other's memory)"
    if size != 2:
        return f"tp_all_reduce fused takes exactly 2 ranks, not tensor_parallel_size {size}"
    if backend != "triton":
        return "tp_all_reduce fused needs the triton attention backend (its kernels do the sums)"
    if not ranks_share_host:
        return "tp_all_reduce fused needs both ranks on one host; these span hosts"
    return None


def check_fused(config) -> None:
    """ValueError naming why ``config`` (an ``EngineConfig`` with tp_all_reduce fused) cannot
    fold its all-reduces (``fused_refusal``)."""
    why = fused_refusal(config.device, config.tensor_parallel_size, config.attention_backend,
                        _ranks_share_host(config.tensor_parallel_size))  # fmt: skip
    if why:
        raise ValueError(why)


def _ranks_share_host(size: int) -> bool:
    """Always when the engine started the ranks; under torchrun when its local world is the
    whole world."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return torchrun_env() is None or (local is not None and int(local) == size)


class _OneShot:
    """In-place all-reduces of up to ``ONE_SHOT_MAX_BYTES`` of bf16 or float32 through a
    symmetric-memory buffer: ``torch.ops.symm_mem.one_shot_all_reduce_copy_out``, one kernel
    that copies the rank's input into its buffer, meets the other ranks, sums every rank's
    buffer into the input and meets them again before the buffer can be written anew.
    Captured in CUDA graphs as NCCL's collectives are. float16 is not one of its dtypes
    (torch 2.11: "not implemented for 'Half'"): NCCL sums those."""

    DTYPES = (torch.bfloat16, torch.float32)
    used_in_process = False  # one rendezvous per process: one_shot_refusal says why

    def __init__(self, device: torch.device, group_name: str) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        _OneShot.used_in_process = True
        self.group_name = group_name
        self.buf = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, group_name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    @classmethod
    def agreed(cls, group: TPGroup, setting: str) -> _OneShot | None:
        """With ``setting`` auto, the one-shot all-reduce on every rank or on none (NCCL then):
        the ranks vote through NCCL before they allocate, and again after a check of exact
        sums. Every rank has the same setting: nccl needs no vote."""
        if setting != "auto":
            return None
        has_op = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        why = one_shot_refusal(_ranks_share_host(group.size), cls.used_in_process, has_op)
        if group.min_int(0 if why else 1) == 0:
            logger.info("all-reduce: NCCL (%s)", why or "another rank's choice")
            return None
        one_shot = None
        try:
            one_shot = cls(group.device, dist.group.WORLD.group_name)
            why = one_shot.check(group.rank, group.size)
        except Exception as exc:  # peer access refused, an op that fails: NCCL serves
            why = f"{type(exc).__name__}: {exc}"
        if group.min_int(0 if why else 1) == 0:
            logger.warning("all-reduce: NCCL, the one-shot kernel failed its check (%s)",
                           why or "on another rank")  # fmt: skip
            return None
        logger.info("all-reduce: one-shot (symmetric memory) up to %d bytes, NCCL above",
                    ONE_SHOT_MAX_BYTES)  # fmt: skip
        return one_shot

    def check(self, rank: int, size: int) -> str | None:
        """None when the kernel sums small integers exactly in each dtype, at every size it
        takes (one row up to the whole buffer); else what went wrong."""
        dev = self.buf.device
        for dtype in self.DTYPES:
            full = ONE_SHOT_MAX_BYTES // (torch.finfo(dtype).bits // 8)
            for numel in (8, 4096, full):
                base = torch.arange(numel, device=dev) % 61  # sums exact in bf16 too
                x = (base + rank).to(dtype)
                want = (base * size + sum(range(size))).to(dtype)
                if not self.all_reduce(x) or not torch.equal(x, want):
                    return f"{dtype} sums of {numel} elements differ from the exact ones"
        return None

    def all_reduce(self, x: torch.Tensor) -> bool:
        """``x`` summed over the ranks, in place; False (nothing done) when it does not fit."""
        nbytes = x.numel() * x.element_size()
        if nbytes > ONE_SHOT_MAX_BYTES or x.dtype not in self.DTYPES or not x.is_contiguous():
            return False
        buf = self.buf[:nbytes].view(x.dtype).view(x.shape)
        self.op(buf, x, "sum", self.group_name, x)
        return True


class _Fused:
    """tp_all_reduce fused on this rank: its symmetric buffer (two receive slots of tagged
    words), the other rank's mapped here, the call counter and status;
    ``fold`` hands the kernels their views (``kernels.fold.AllReduceFold``) for a hidden size
    and dtype. Set up by ``agreed`` on both ranks or on none."""

    NBYTES = 2 * FOLD_SLOT_BYTES  # each rank's buffer

    def __init__(self, buf: torch.Tensor, peer_buf: torch.Tensor, handle=None) -> None:
        """``buf``: this rank's buffer (``NBYTES`` uint8, zeroed), ``peer_buf``: the other's
        as mapped here; ``handle`` keeps the rendezvous alive."""
        self.buf, self.peer_buf, self.handle = buf, peer_buf, handle
        self.calls = torch.zeros(1, dtype=torch.int64, device=buf.device)
        self.status = torch.zeros(1, dtype=torch.int64, device=buf.device)
        self.folds: dict[tuple[int, torch.dtype], AllReduceFold] = {}

    @classmethod
    def rendezvous(cls, group: TPGroup) -> _Fused:
        """Allocate this rank's buffer in symmetric memory and map the other's (collective)."""
        import torch.distributed._symmetric_memory as symm_mem

        _OneShot.used_in_process = True  # one rendezvous per process: one_shot_refusal says why
        buf = symm_mem.empty(cls.NBYTES, dtype=torch.uint8, device=group.device)
        handle = symm_mem.rendezvous(buf, dist.group.WORLD.group_name)
        buf.zero_()  # tag 0, no call's, before the other rank may write (a vote follows)
        peer_buf = handle.get_buffer(1 - group.rank, (cls.NBYTES,), torch.uint8, 0)
        torch.cuda.synchronize(group.device)
        return cls(buf, peer_buf, handle)

    @classmethod
    def agreed(cls, group: TPGroup) -> _Fused:
        """The folded all-reduce on both ranks, checked (exact sums against NCCL's); a
        RuntimeError on both when either cannot: never NCCL in its place."""
        why = fused_refusal(group.device.type, group.size, "triton", _ranks_share_host(group.size))
        if why is None and _OneShot.used_in_process:
            why = ("this process already made a symmetric-memory rendezvous (torch numbers "
                   "them per process: one_shot_refusal)")  # fmt: skip
        if why is None and importlib.util.find_spec("torch.distributed._symmetric_memory") is None:
            why = f"torch {torch.__version__} has no symmetric memory"
        fused = None
        if group.min_int(0 if why else 1) == 1:  # the votes: every rank takes the same path
            try:
                fused = cls.rendezvous(group)
            except Exception as exc:  # peer access refused, no NVLink/P2P
                why = f"{type(exc).__name__}: {exc}"
            if group.min_int(0 if why else 1) == 1:  # both slots zeroed before a GEMV writes
                try:
                    why = fused.check(group)
                except Exception as exc:  # a kernel that fails
                    why = f"{type(exc).__name__}: {exc}"
        if group.min_int(0 if why else 1) == 0:
            raise RuntimeError(f"tp_all_reduce fused cannot run: {why or 'the other rank failed'}")
        logger.info("all-reduce: folded into the row-parallel GEMVs and the norms after them "
                    "for steps of up to %d tokens, NCCL for the rest", FOLD_ROWS)  # fmt: skip
        return fused

    def fold(self, hidden: int, dtype: torch.dtype) -> AllReduceFold:
        """The kernels' views for activations of ``hidden`` columns in ``dtype``: each slot
        ``[ROWS, hidden]`` words at its fixed offset (ValueError when it does not fit)."""
        key = (hidden, dtype)
        if key not in self.folds:
            if FOLD_ROWS * hidden * FOLD_WORD_BYTES > FOLD_SLOT_BYTES:
                raise ValueError(f"tp_all_reduce fused: {FOLD_ROWS} rows of {hidden} words "
                                 f"do not fit its slots of {FOLD_SLOT_BYTES} bytes")  # fmt: skip
            views = [self._slots(b, hidden) for b in (self.buf, self.peer_buf)]
            self.folds[key] = AllReduceFold(send=views[1], recv=views[0], dtype=dtype,
                                            calls=self.calls, status=self.status)  # fmt: skip
        return self.folds[key]

    @staticmethod
    def _slots(buf: torch.Tensor, hidden: int) -> torch.Tensor:
        """``[2, ROWS, hidden]`` int64 words over the two slots of ``buf`` (bytes)."""
        used = FOLD_ROWS * hidden * FOLD_WORD_BYTES
        return buf.view(2, FOLD_SLOT_BYTES)[:, :used].view(torch.int64).view(2, FOLD_ROWS, hidden)

    def check(self, group: TPGroup) -> str | None:
        """None when three folded calls (both slots, one reused) give NCCL's sums exactly
        (small integers: exact in any order); else what went wrong."""
        from kernels.gemv import linear_small_m
        from kernels.norm import add_rms_norm

        dev, hidden = group.device, 256
        # a stuck rank shows as a status here within seconds, not minutes
        fold = dataclasses.replace(self.fold(hidden, torch.float32), spin_limit=CHECK_SPINS)
        w = (torch.arange(hidden * 32, device=dev) % 5 - 2).float().view(hidden, 32)
        ones = torch.ones(hidden, device=dev)
        for call in range(3):
            x = (torch.arange(2 * 32, device=dev) % 7 + group.rank + call).float().view(2, 32)
            res = torch.full((2, hidden), float(call), device=dev)
            out = linear_small_m(x, w, fold=fold, chain=False)
            _, summed = add_rms_norm(out, res, ones, 1e-6, fold=fold, chain=False)
            want = out.clone()
            dist.all_reduce(want)
            if not torch.equal(summed, res + want):
                return f"call {call}: the folded sums differ from NCCL's"
        if fold.failed():
            return f"a norm gave up waiting for the words tagged {fold.failed()}"
        return None
