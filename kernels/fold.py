"""The all-reduce of two tensor-parallel ranks folded into the kernels around it: the
row-parallel GEMV (``kernels.gemv``, o_proj and down_proj at decode sizes) sends its partial
sums to the other rank, and the residual add + RMSNorm after it (``kernels.norm``) waits for
them and adds them to its own. No collective is launched; an all-reduce costs a flag's trip
over NVLink (issue 18, docs/benchmarks/tensor-parallel.md).

Each rank ``r`` (the other one ``p``) holds, in symmetric memory (mapped on ``p`` too):

- ``recv [2, R, H]`` in the activations' dtype: slot ``k % 2`` receives ``p``'s partial sums
  of call ``k`` (``R``: the most rows a folded call takes, ``H``: the hidden size; rows
  contiguous, the slots at any distance);
- ``recv_flag [1]`` int64: ``p``'s GEMV programs add to it, after their stores of call ``k``,
  contributions that sum to ``UNIT`` a call (``send_contribution``): it reads at least
  ``(k + 1) * UNIT`` exactly when all of call ``k``'s stores have been released;

and in its own memory ``calls [1]`` int64, which its norm programs advance by ``UNIT`` a call
the same way (each program's add returns the call number, ``old // UNIT``), and ``status
[1]`` int64: 0, or the flag value a norm gave up waiting for (``spin_limit`` reads). The GEMV
is handed ``p``'s ``recv`` and ``recv_flag`` as ``send`` and ``send_flag`` (``p``'s pointers
mapped on ``r``) and reads ``calls``; the norm reads its own ``recv``, ``recv_flag`` and bumps
``calls``.

Why call ``k`` reads neither stale nor half-written sums, with two slots and flags that only
grow (so CUDA-graph replays need no reset):

1. ``p``'s GEMV of call ``k`` reads ``calls == k * UNIT`` (its norms of calls ``< k`` ran
   before it on its stream), stores into slot ``k % 2`` of ``r``'s ``recv``, then each
   program, after a barrier (every thread's stores issued), adds to ``r``'s flag with release
   semantics at system scope; ``r``'s norm of call ``k`` spins until the flag reaches
   ``(k + 1) * UNIT`` with acquire semantics at system scope, so it sees every store of that
   call. Call ``k + 1``'s contributions cannot make up the count early: ``p``'s GEMV of call
   ``k + 1`` runs after its GEMV of call ``k`` has ended (stream order; the PDL chain's
   ``gdc_wait`` keeps it), so every add of call ``k`` precedes any of ``k + 1``. The norm
   reads the slot past L1 (``.cg``): a line an earlier call left there is never reused.
2. ``p`` writes slot ``k % 2`` again at call ``k + 2``. That GEMV runs after ``p``'s norm of
   call ``k + 1`` (stream order), which waited for ``r``'s GEMV of call ``k + 1``, which ran
   after ``r``'s norm of call ``k`` (stream order), the reader of the slot: the reads of call
   ``k`` happen before the writes of call ``k + 2``. One slot would not do: ``p`` could write
   call ``k + 1``'s sums while ``r``'s norm of call ``k`` still reads.
3. Both ranks run the same sequence of folded calls (the same steps, each with the same
   layers), so their ``k`` agree; steps that do not fold (prefill sizes, NCCL) touch neither
   flags nor counters. Flags and counters are int64: at ``UNIT = 2^24`` they last 2^39 calls.

A rank held back (its GEMV late) only makes the other's norm spin longer. ``spin_limit`` bounds
the spin (the host sets it far beyond any step); a norm that reaches it writes the flag value
it waited for into ``status`` and goes on with whatever the slot holds: the host reads
``status`` to tell (``AllReduceFold.failed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

UNIT = 1 << 24  # what a call adds to a flag or a counter: more than any grid's programs
_UNIT = tl.constexpr(UNIT)
ROWS = 16  # the most rows (tokens) a folded call takes: kernels.gemv.MAX_M
# a norm that waits longer than this many reads of its flag gives up (status); each read is
# an atomic at the GPU's L2, well under 1 us: minutes, longer than NCCL's own timeout
SPIN_LIMIT = 1 << 40


@dataclass(frozen=True)
class AllReduceFold:
    """One rank's half of the folded all-reduce (the module doc): the peer's receive slots
    and flag as mapped here (``send``, ``send_flag``), its own (``recv``, ``recv_flag``),
    its call counter and status."""

    send: torch.Tensor  # [2, R, H] the peer's slots, written by this rank's GEMV
    send_flag: torch.Tensor  # [1] int64, the peer's flag
    recv: torch.Tensor  # [2, R, H] this rank's slots, written by the peer's GEMV
    recv_flag: torch.Tensor  # [1] int64, this rank's flag
    calls: torch.Tensor  # [1] int64, this rank's folded calls times UNIT
    status: torch.Tensor  # [1] int64: 0, or the flag value a norm gave up on
    spin_limit: int = SPIN_LIMIT

    def __post_init__(self) -> None:
        if self.send.shape != self.recv.shape or self.send.dim() != 3 or self.send.shape[0] != 2:
            raise ValueError(f"send and recv must both be [2, R, H]; got "
                             f"{tuple(self.send.shape)}, {tuple(self.recv.shape)}")  # fmt: skip
        if self.send.dtype != self.recv.dtype:
            raise ValueError(f"send {self.send.dtype} and recv {self.recv.dtype} differ")
        h = self.recv.shape[2]
        if self.send.stride() != self.recv.stride() or self.recv.stride()[1:] != (h, 1):
            raise ValueError(f"send and recv must have contiguous rows [R, H] and the same "
                             f"strides; got {self.send.stride()}, "
                             f"{self.recv.stride()}")  # fmt: skip
        for name in ("send_flag", "recv_flag", "calls", "status"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.numel() != 1:
                raise ValueError(f"{name} must be one int64; got {t.dtype} {tuple(t.shape)}")

    @property
    def rows(self) -> int:
        return self.recv.shape[1]

    @property
    def hidden(self) -> int:
        return self.recv.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.recv.dtype

    def check(self, out: torch.Tensor, what: str) -> None:
        """ValueError unless ``out`` [M, H] (a folded GEMV's output, a folded norm's input)
        fits the slots."""
        m, h = out.shape
        if h != self.hidden or m > self.rows or out.dtype != self.dtype:
            raise ValueError(f"{what} {out.dtype} {tuple(out.shape)} does not fit the folded "
                             f"all-reduce's slots ({self.dtype}, up to {self.rows} x "
                             f"{self.hidden})")  # fmt: skip
        if out.device != self.recv.device:
            raise ValueError(f"{what} on {out.device}, the folded all-reduce on "
                             f"{self.recv.device}")  # fmt: skip

    def failed(self) -> int:
        """0, or the flag value a norm gave up waiting for (a sync)."""
        return int(self.status.item())


def flag_target(calls: int) -> int:
    """The flag value a norm of call ``calls // UNIT`` waits for (``calls``: the counter as
    its first program finds it): the host's mirror of ``fold_wait``, for tests."""
    return (calls // UNIT + 1) * UNIT


@triton.jit
def _contribution(n):
    """This program's share of ``UNIT`` among the ``n`` programs of its grid: 1 each, the
    first program the rest; every share is >= 1, so the sum reaches ``UNIT`` only when all
    have added."""
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    return tl.where(first, _UNIT - n + 1, 1).to(tl.int64)


@triton.jit
def fold_slot(Calls):
    """The GEMV's slot of this call: ``k % 2``, ``k`` from the rank's counter (read past L1:
    the previous norm advanced it with atomics)."""
    k = tl.load(Calls, cache_modifier=".cg") // _UNIT
    return k % 2


@triton.jit
def fold_send_done(SendFlag):
    """After a GEMV program's stores to the peer: a barrier (every thread's stores issued),
    then its share of ``UNIT`` added to the peer's flag, released at system scope."""
    n = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    tl.debug_barrier()
    tl.atomic_add(SendFlag, _contribution(n), sem="release", scope="sys")


@triton.jit
def fold_wait(Calls, RecvFlag, Status, spin_limit):
    """A norm program's wait: advance the rank's counter by its share (the old value gives
    the call ``k``), spin until the flag reaches ``(k + 1) * UNIT`` (acquire, system scope)
    or ``spin_limit`` reads (then ``status`` gets the target); the slot ``k % 2``. The
    caller loads the slot with ``.cg`` after it."""
    n = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    k = tl.atomic_add(Calls, _contribution(n), sem="relaxed", scope="gpu") // _UNIT
    target = (k + 1) * _UNIT
    seen = tl.atomic_add(RecvFlag, 0, sem="acquire", scope="sys")
    spins = tl.cast(0, tl.int64)
    while (seen < target) & (spins < spin_limit):
        seen = tl.atomic_add(RecvFlag, 0, sem="acquire", scope="sys")
        spins += 1
    if seen < target:
        tl.store(Status, target)
    tl.debug_barrier()  # every thread's loads of the slot after the acquire
    return k % 2
