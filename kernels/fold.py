"""The all-reduce of two tensor-parallel ranks folded into the kernels around it: the
row-parallel GEMV (``kernels.gemv``, o_proj and down_proj at decode sizes) sends its partial
sums to the other rank, and the residual add + RMSNorm after it (``kernels.norm``) waits for
them and adds them to its own. No collective is launched, and no fence or flag either: each
value travels in one 8-byte word with its call's tag beside it (NCCL's "LL" protocol), so a
word that carries this call's tag carries this call's value (issue 18,
docs/benchmarks/tensor-parallel.md).

Each rank ``r`` (the other one ``p``) holds, in symmetric memory (mapped on ``p`` too),
``recv [2, R, H]`` int64 words: slot ``k % 2`` receives ``p``'s partial sums of call ``k``
(``R``: the most rows a folded call takes, ``H``: the hidden size; rows contiguous, the slots
at any distance), each value's bits in the low 32 (a float32, or a 16-bit float
zero-extended) and the call's tag ``k mod (2^31 - 1) + 1`` in the high 32 (``call_tag``). In
its own memory it holds ``calls [1]`` int64, which its norm programs advance by ``UNIT`` a
call (each program adds its share, ``_contribution``; the old value gives the call number,
``old // UNIT``), and ``status [1]`` int64: 0, or the tag a norm gave up waiting for
(``spin_limit`` reads). The GEMV is handed ``p``'s ``recv`` as ``send`` (mapped on ``r``) and
reads ``calls``; the norm reads its own ``recv`` and bumps ``calls``.

Why call ``k`` reads neither stale nor half-written sums, with two slots and no reset between
CUDA-graph replays:

1. ``p``'s GEMV of call ``k`` reads ``calls == k * UNIT`` (its norms of calls ``< k`` ran
   before it on its stream) and stores each value of slot ``k % 2`` as one aligned 8-byte
   word with the tag of ``k``. An aligned 8-byte store is seen whole or not at all, so
   ``r``'s norm, which re-reads (volatile) its row's words until every one carries that tag,
   reads exactly the values of call ``k``. No ordering between words is needed, hence no
   fence: a sender's program ends as soon as its stores are issued.
2. ``p`` writes slot ``k % 2`` again at call ``k + 2``. That GEMV runs after ``p``'s norm of
   call ``k + 1`` (stream order), which waited for ``r``'s GEMV of call ``k + 1``, which ran
   after ``r``'s norm of call ``k`` (stream order), the reader of the slot: the reads of call
   ``k`` are done before the writes of call ``k + 2``. One slot would not do: ``p`` could write
   call ``k + 1``'s words while ``r``'s norm of call ``k`` still reads, and it would wait for
   tag ``k`` forever. Slot ``k % 2`` last held call ``k - 2``, whose tag differs.
3. Both ranks run the same sequence of folded calls (the same steps, each with the same
   layers), so their ``k`` agree; steps that do not fold (prefill sizes, NCCL) touch neither
   slots nor counters. The counter is int64: at ``UNIT = 2^24`` it lasts 2^39 calls.

A rank held back (its GEMV late) only makes the other's norm spin longer. ``spin_limit`` bounds
the spin (the host sets it far beyond any step); a norm that reaches it writes the tag it
waited for into ``status`` and goes on with whatever the slot holds: the host reads ``status``
to tell (``AllReduceFold.failed``).

Before (sessions 15-18) each GEMV program added to a flag on the peer with release semantics
at system scope, and the norm spun on that flag: two H200s, Llama-3-8B at TP=2, 32K, kernels
alone (``bench decode --profile``, no PDL chain), µs a layer against the same GEMVs under
NCCL: o_proj (1,024 programs) 12.9 / 7.0, down_proj (512) 18.5 / 16.1, each norm 3.1 / 2.2:
the release waits for the program's stores to cross NVLink, once a program.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

UNIT = 1 << 24  # what a call adds to a counter: more than any grid's programs
_UNIT = tl.constexpr(UNIT)
TAG_MOD = (1 << 31) - 1  # call_tag: k mod this, plus 1 (never 0, the zeroed slots' tag)
_TAG_MOD = tl.constexpr(TAG_MOD)
ROWS = 16  # the most rows (tokens) a folded call takes: kernels.gemv.MAX_M
WORD_BYTES = 8  # a value and its tag
# a norm that waits longer than this many reads of its row gives up (status); each read is
# a volatile load at the GPU's L2, well under 1 us: minutes, longer than NCCL's own timeout
SPIN_LIMIT = 1 << 40
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # values of at most 32 bits


@dataclass(frozen=True)
class AllReduceFold:
    """One rank's half of the folded all-reduce (the module doc): the peer's receive slots as
    mapped here (``send``), its own (``recv``), the activations' dtype, its call counter and
    status."""

    send: torch.Tensor  # [2, R, H] int64 words: the peer's slots, written by this rank's GEMV
    recv: torch.Tensor  # [2, R, H] int64 words: this rank's slots, written by the peer's GEMV
    dtype: torch.dtype  # the values' (the activations')
    calls: torch.Tensor  # [1] int64, this rank's folded calls times UNIT
    status: torch.Tensor  # [1] int64: 0, or the tag a norm gave up on
    spin_limit: int = SPIN_LIMIT

    def __post_init__(self) -> None:
        if self.send.shape != self.recv.shape or self.send.dim() != 3 or self.send.shape[0] != 2:
            raise ValueError(f"send and recv must both be [2, R, H]; got "
                             f"{tuple(self.send.shape)}, {tuple(self.recv.shape)}")  # fmt: skip
        if self.send.dtype != torch.int64 or self.recv.dtype != torch.int64:
            raise ValueError(f"send and recv must be int64 words; got {self.send.dtype}, "
                             f"{self.recv.dtype}")  # fmt: skip
        if self.dtype not in DTYPES:
            raise ValueError(f"the folded values must be one of {DTYPES}, not {self.dtype}")
        h = self.recv.shape[2]
        if self.send.stride() != self.recv.stride() or self.recv.stride()[1:] != (h, 1):
            raise ValueError(f"send and recv must have contiguous rows [R, H] and the same "
                             f"strides; got {self.send.stride()}, "
                             f"{self.recv.stride()}")  # fmt: skip
        for name in ("calls", "status"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.numel() != 1:
                raise ValueError(f"{name} must be one int64; got {t.dtype} {tuple(t.shape)}")

    @property
    def rows(self) -> int:
        return self.recv.shape[1]

    @property
    def hidden(self) -> int:
        return self.recv.shape[2]

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
        """0, or the tag a norm gave up waiting for (a sync)."""
        return int(self.status.item())


def call_tag(calls: int) -> int:
    """The tag of the words of call ``calls // UNIT`` (``calls``: the counter as the call's
    GEMV finds it): the host's mirror of the kernels', for tests."""
    return calls // UNIT % TAG_MOD + 1


@triton.jit
def _contribution(n):
    """This program's share of ``UNIT`` among the ``n`` programs of its grid: 1 each, the
    first program the rest; every share is >= 1, so the sum reaches ``UNIT`` only when all
    have added."""
    first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0)
    return tl.where(first, _UNIT - n + 1, 1).to(tl.int64)


@triton.jit
def fold_call(Calls):
    """The GEMV's call ``k`` from the rank's counter (read past L1: the previous norm advanced
    it with atomics): its slot ``k % 2`` and its words' tag."""
    k = tl.load(Calls, cache_modifier=".cg") // _UNIT
    return k % 2, k % _TAG_MOD + 1


@triton.jit
def fold_send(ptrs, y, mask, tag):
    """Store ``y`` (values in the activations' dtype) as tagged words at ``ptrs``."""
    if y.dtype == tl.float32:
        bits = y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    else:
        bits = y.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
    tl.store(ptrs, bits | (tag.to(tl.int64) << 32), mask=mask)


@triton.jit
def fold_recv(Recv, stride_recv, offs, mask, Calls, Status, spin_limit, DTYPE: tl.constexpr):
    """A norm program's half of call ``k``: advance the rank's counter by its share (the old
    value gives ``k``), re-read (volatile) its row's words ``Recv + k % 2 * stride_recv +
    offs`` until every one under ``mask`` carries the tag of ``k``, or ``spin_limit`` reads
    (then ``status`` gets the tag); the values, in ``DTYPE``.

    The first read takes both slots' words, issued before the counter's add, so that the
    three round trips to L2 overlap instead of following one another (the add's result picks
    the slot); the other slot's words (call ``k - 1``'s, or ``k + 1``'s being written) are
    dropped, and a word is taken only with this call's tag, as before."""
    first0 = tl.load(Recv + offs, mask=mask, other=0, volatile=True)
    first1 = tl.load(Recv + stride_recv + offs, mask=mask, other=0, volatile=True)
    n = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    k = tl.atomic_add(Calls, _contribution(n), sem="relaxed", scope="gpu") // _UNIT
    tag = k % _TAG_MOD + 1
    ptrs = Recv + (k % 2) * stride_recv + offs
    words = tl.where(k % 2 == 0, first0, first1)
    missing = tl.sum((((words >> 32) != tag) & mask).to(tl.int32), axis=0)
    spins = tl.cast(0, tl.int64)
    while (missing > 0) & (spins < spin_limit):
        words = tl.load(ptrs, mask=mask, other=0, volatile=True)
        missing = tl.sum((((words >> 32) != tag) & mask).to(tl.int32), axis=0)
        spins += 1
    if missing > 0:
        tl.store(Status, tag)
    low = (words & 0xFFFFFFFF).to(tl.int32)
    if DTYPE == tl.float32:  # (one return: the compiler would build both)
        values = low.to(tl.float32, bitcast=True)
    else:
        values = low.to(tl.int16).to(DTYPE, bitcast=True)
    return values
