"""One persistent launch per decode layer at batch 1: the layer's four float8 GEMVs in one
kernel, grid-wide barriers between them, against the project's four launches (a measurement
prototype for the GPU, not production code; nothing here gates CI).

    python3 docs/benchmarks/persistent_gemv.py --layers 32 --json OUT.json   # the GPU run
    python3 docs/benchmarks/persistent_gemv.py --sm90-report   # no GPU: compile for sm_90

The math, one token, e4m3 weights ``Q [N, K]`` (row-major) with one float32 scale a row
(``kernels.quant``'s per-channel layout, ``W[n, k] = Q[n, k] * S[n]``)::

    qkv    = S_qkv * (Q_qkv @ x)          [NQ]  x [H], Q_qkv [NQ, H]
    r1     = x + S_o * (Q_o @ qkv[:H])    [H]   (qkv's first H values stand in for attention)
    [g; u] = S_gu * (Q_gu @ r1)           [2I]  Q_gu's rows 0..I-1 the gate, I..2I-1 the up
    h      = silu(g) * u                  [I]
    out    = r1 + S_d * (Q_d @ h)         [H]

each stored in x's dtype and read back from there by the next GEMV; the epilogues work on the
float32 sums (one rounding each: the residual adds round once, where ``linear_small_m``'s
``residual=`` rounds the product first).

Work split: a phase's weight rows are cut into tiles of BLOCK_N rows x all of K (the gated
phase: BLOCK_N / 2 gate rows interleaved with the up rows of the same outputs, as
``kernels.gemv``'s GATED tiles; the last tile moved back to end where the rows end, over the
one before it: ``_tile_start``). Program ``p`` of ``P`` takes tiles ``[p T / P, (p + 1) T /
P)``, contiguous, counts within one of each other (16-row tiles on 132 SMs: qkv 2.9 a program,
o_proj and down 1.9, gate_up 13.6: the busiest program has <= 3% more than the mean; 32-row
tiles leave qkv at 1.45, 2 for the busiest), and walks them as ONE loop of (tile, K step)
units, so the software pipeline (``num_stages``) runs through tile boundaries: a persistent
program has no other program on its SM to hide a pipeline that drains and refills at each
tile. The tile's epilogue sits in that loop, behind a branch taken at a tile's last K step.

The dot (``_dot_step``): ``kernels.gemv``'s M = 1 float8 path (``diag``, the engine's at
M = 1): e4m3 widened to f16 (exact), x rounded to f16, ``tl.dot`` on the tensor cores with
x's K step as 8 chunks side by side (8 columns) against the weight tile viewed as 8x the rows,
the diagonal blocks kept at the tile's end. The tile's rows are split into GROUPS batched dots
(GROUPS = num_warps: a warp each, mma.sync as the engine's one-warp tiles; one dot over 4
warps takes wgmma, x through shared memory). sm_90 compile reports (``--sm90-report``, Triton
3.9), SASS instructions a weight byte a thread of a phase's loop without the epilogue, 4 warps:
(16, 1024) 1.70-1.82, (32, 512) 1.52-1.61, (16, 512) 2.22-2.28, (16, 512) as one wgmma dot
2.33-2.42; the engine's (16, 256, 1 warp) diag tile 1.41 (its whole loop): a warp here has 4
or 8 rows where the engine's has 16, so x's conversion is shared by fewer weight bytes. No
spills; 80-168 registers, 28-87 KB of shared memory (one program an SM: room to spare).
Unlike ``kernels.gemv`` there is no rerun for x outside f16's range (|x| > 65504, or rows
whose largest value is under 2^-10): the benchmark's values are O(1).

The barrier (``_arrive``, ``_wait``): ``Sync`` [4] int32, per device and grid size, zero when
made: ``Sync[b]`` counts the arrivals at barrier ``b`` (0..2) over all launches so far,
``Sync[3]`` is the launch's epoch ``E``, the number of launches before it. Each program reads
``E`` first; at barrier ``b`` it waits until ``Sync[b] == (E + 1) P``. Program 0 stores
``E + 1`` after barrier 0, when every program has read ``E`` (each read comes before its
arrival, a release). No memset, no reset at the end, and CUDA-graph replays work (the epoch
lives in memory, not in an argument, which a graph would freeze); counts wrap at 2^32 and
equality still holds. Launches with one ``Sync`` must not overlap, except through
``_chain_enter``'s wait, and have the same P (hence a buffer per grid size).

Visibility. Arrival: ``bar.sync`` (the program's stores of the phase issued and ordered before
what follows, CTA scope), then one thread's ``red.add`` with release semantics at GPU scope
(cumulative over what the bar.sync ordered: cooperative groups' grid sync does the same with a
``__threadfence()`` and a relaxed add). Wait: every thread re-reads the count with volatile
loads (L2, not L1) until it is reached, then ``fence.acq_rel.gpu``: a read followed by that
fence is an acquire in PTX's memory model, so that thread's later loads see what every
program released; a ``bar.sync`` then keeps the program together. The previous phases'
outputs are also read ``.cg`` (from L2, the GPU's point of coherence, never a line L1 kept)
for good measure. (Triton 3.9's ``tl.atomic_poll`` does the same with one thread and a
timer; the GPU machine's Triton 3.6 predates it.)

PREFETCH: between the arrival and the wait, each program issues the loads of its first
PREFETCH K steps of the next phase into registers (weights do not depend on the phase
before), so they are in flight during the wait; after it, that part of the first tile is one
wider dot, then the pipelined loop goes on from there. Issued after the arrival: a release
waits for the program's earlier memory operations, loads in flight included.
``chain=True`` (variant D of the benchmark) also launches each layer early by programmatic
dependent launch: its programs prefetch their first qkv tile into L2 and wait for the layer
before in-kernel (``_chain_enter``), as the engine's kernels chain.

Deadlock: every program must be resident at once. The launcher refuses a grid larger than the
SMs times the programs that fit one SM (registers, shared memory, warps: from the compiled
kernel); and a wait gives up after ``spin_limit`` reads, counts itself in a status word
(``barrier_timeouts``) and goes on (its results are then wrong): a mistake costs seconds,
not a hung GPU. Under Triton's interpreter the programs run one after another: a barrier
there completes only with ``programs=1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's kernels

from kernels.activation import gate_act  # noqa: E402
from kernels.common import num_sms, pdl_kwargs, pdl_wait  # noqa: E402
from kernels.decode import _prefetch_rows  # noqa: E402  (sm_90's bulk L2 prefetch)

# a phase's epilogue (EPI): the product, the residual added, silu(gate) * up
_PLAIN, _RESIDUAL, _GATED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
_CHUNKS = tl.constexpr(8)  # the diag dot's columns: x's K step as 8 chunks
# a barrier wait gives up after this many reads of its count (each an L2 round trip, >= 0.5 us:
# seconds); the interpreter's tests take a few
SPIN_LIMIT = 1 << 22


# ---------------------------------------------------------------- kernel


@triton.jit
def _tile_start(tile, N, NI, BLOCK_N: tl.constexpr, EPI: tl.constexpr):
    """The first output column of ``tile``: tiles are BN columns apart (gated: BN / 2), the
    last one moved back to end where the output ends (it overlaps the one before, and both
    store the same sums there): every tile is whole, its loads and stores unmasked, and its
    weight a scalar base plus ``_tile_rows``."""
    if EPI == _GATED:
        col0 = tl.minimum(tile * (BLOCK_N // 2), NI - BLOCK_N // 2)
    else:
        col0 = tl.minimum(tile * BLOCK_N, N - BLOCK_N)
    return col0


@triton.jit
def _tile_rows(NI, BLOCK_N: tl.constexpr, EPI: tl.constexpr):
    """A tile's weight rows from its first output column's row [BN]: ``c``, or gated (EPI 2)
    gate row ``j`` at ``c = 2j`` and up row ``NI + j`` at ``2j + 1``."""
    c = tl.arange(0, BLOCK_N)
    if EPI == _GATED:
        c = c // 2 + (c % 2) * NI
    return c


@triton.jit
def _acc0(BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    """A zero accumulator: [8 BN, 8], or [G, 8 BN / G, 8] with GROUPS > 1 (``_dot_step``)."""
    if GROUPS == 1:
        acc = tl.zeros([BLOCK_N * _CHUNKS, _CHUNKS], tl.float32)
    else:
        acc = tl.zeros([GROUPS, BLOCK_N * _CHUNKS // GROUPS, _CHUNKS], tl.float32)
    return acc


@triton.jit
def _dot_step(acc, w, X, k0, X_CG: tl.constexpr, GROUPS: tl.constexpr):
    """``acc += `` the diag dot of ``w [BN, PK]`` (e4m3) with ``x[k0 : k0 + PK]``: row
    ``8 n + c`` of acc (rows counted through its groups) gets ``acc[8 n + c, g] += sum_r
    w[n, c PK / 8 + r] * x[k0 + g PK / 8 + r]`` (c == g kept at the end). GROUPS > 1: the
    tile's rows in GROUPS groups, a batched dot (one warp a group: mma.sync, where one dot
    over 4 warps takes wgmma with x through shared memory). X_CG: x was written by other
    programs of this launch: read it from L2."""
    BN: tl.constexpr = w.shape[0]
    C: tl.constexpr = w.shape[1] // _CHUNKS
    offs = (tl.arange(0, _CHUNKS) * C)[None, :] + tl.arange(0, C)[:, None]  # [C, 8]
    if X_CG:
        x = tl.load(X + k0 + offs, cache_modifier=".cg")
    else:
        x = tl.load(X + k0 + offs)
    x = x.to(tl.float16)
    w = w.to(tl.float16)  # e4m3 widens exactly
    if GROUPS == 1:
        acc = tl.dot(tl.reshape(w, [BN * _CHUNKS, C]), x, acc)  # row 8 n + c: chunk c of row n
    else:
        w = tl.reshape(w, [GROUPS, BN * _CHUNKS // GROUPS, C])
        acc = tl.dot(w, tl.broadcast_to(x[None, :, :], [GROUPS, C, _CHUNKS]), acc)
    return acc


@triton.jit
def _store_tile(acc, tile, S, Y, Res, N, NI, BLOCK_N: tl.constexpr, EPI: tl.constexpr):
    """The tile's sums (the diagonal blocks of ``acc``) times the rows' scales, through the
    epilogue (+ Res, or silu(gate) * up), stored in Y's dtype."""
    col0 = _tile_start(tile, N, NI, BLOCK_N, EPI)
    rows = col0 + _tile_rows(NI, BLOCK_N, EPI)  # [BN]
    cols = col0 + tl.arange(0, BLOCK_N // 2 if EPI == _GATED else BLOCK_N)  # [BN / 2] gated
    eye = tl.arange(0, _CHUNKS)[:, None] == tl.arange(0, _CHUNKS)[None, :]  # [8, 8]
    a = tl.reshape(acc, [BLOCK_N, _CHUNKS, _CHUNKS])
    y = tl.sum(tl.sum(tl.where(eye[None, :, :], a, 0.0), 2), 1) * tl.load(S + rows)  # [BN]
    if EPI == _GATED:  # [BN] -> [BN / 2]: gate and up of one output side by side
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        y = gate_act(gate, False, False) * up
    elif EPI == _RESIDUAL:
        y += tl.load(Res + cols, cache_modifier=".cg").to(tl.float32)
    tl.store(Y + cols, y.to(Y.dtype.element_ty))


@triton.jit
def _arrive(Sync, b: tl.constexpr, epoch, SYNC_GROUPS: tl.constexpr):
    """Arrive at grid barrier ``b`` (module doc); loads issued between this and ``_wait`` are
    in flight during the wait. SYNC_GROUPS > 1: two levels, fewer arrivals on one address:
    program ``p`` counts itself in its group's counter ``Sync[4 + 3 g + b]``, ``g = p %
    SYNC_GROUPS`` (acq_rel: the group's last arrival has seen the others' releases), and the
    group's last arrival counts the group in ``Sync[b]`` (release, cumulative over them)."""
    tl.debug_barrier()  # every thread's stores of the phase issued (CTA scope)
    if SYNC_GROUPS == 1:
        tl.atomic_add(Sync + b, 1, sem="release", scope="gpu")  # one thread: red.release.gpu
    else:
        pid, progs = tl.program_id(0), tl.num_programs(0)
        g = pid % SYNC_GROUPS
        size = (progs - g + SYNC_GROUPS - 1) // SYNC_GROUPS  # the group's programs
        old = tl.atomic_add(Sync + 4 + 3 * g + b, 1, sem="acq_rel", scope="gpu")
        if old == (epoch + 1) * size - 1:
            tl.atomic_add(Sync + b, 1, sem="release", scope="gpu")


@triton.jit
def _wait(Counter, target, Status, spin_limit, FENCE: tl.constexpr, POLL1: tl.constexpr):
    """Wait until every program (or group) has arrived (``Counter == target``): re-read the
    count (volatile: from L2) until it is there or ``spin_limit`` reads have gone by (a
    timeout, which adds 1 to Status), then FENCE (on the GPU) ``fence.acq_rel.gpu``: with
    the read before it, an acquire, so the later loads see what the arrivals released.
    POLL1 (GPU only, with FENCE): thread 0 alone polls and fences (PTX), the others wait at
    the CTA barrier after it (as cooperative groups' grid sync); else every thread polls."""
    if POLL1:
        seen = tl.inline_asm_elementwise(
            """{
            .reg .pred %pz, %pw;
            .reg .b32 %tn, %tv;
            mov.u32 $0, $2;
            mov.u32 %tn, %tid.x;
            setp.ne.u32 %pz, %tn, 0;
            @%pz bra POLL_DONE_${:uid};
            mov.u32 %tn, 0;
            POLL_LOOP_${:uid}:
            ld.relaxed.gpu.global.b32 %tv, [$1];
            add.u32 %tn, %tn, 1;
            setp.ne.u32 %pw, %tv, $2;
            setp.lt.and.u32 %pw, %tn, $3, %pw;
            @%pw bra POLL_LOOP_${:uid};
            mov.u32 $0, %tv;
            fence.acq_rel.gpu;
            POLL_DONE_${:uid}:
            }""",
            "=r,l,r,r", [Counter, target, spin_limit], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        if seen != target:  # thread 0's count (the others hold target)
            tl.atomic_add(Status, 1)
    else:
        seen = tl.load(Counter, volatile=True)
        spins = tl.cast(0, tl.int32)
        while (seen != target) & (spins < spin_limit):
            seen = tl.load(Counter, volatile=True)
            spins += 1
        if seen != target:
            tl.atomic_add(Status, 1)
        if FENCE:
            tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, $1;", "=r,r", [seen],
                                      dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip
    tl.debug_barrier()


@triton.jit
def _phase(X, W, S, Y, Res, Sync, epoch, target, Status, spin_limit, N, NI, K: tl.constexpr,
           BARRIER: tl.constexpr, EPI: tl.constexpr, X_CG: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
           PREFETCH: tl.constexpr, GROUPS: tl.constexpr, FENCE: tl.constexpr,
           SYNC_GROUPS: tl.constexpr, POLL1: tl.constexpr,
           L2_STEPS: tl.constexpr):  # fmt: skip
    """This program's tiles of one GEMV ``Y = epi(S * (W @ X))``, W [N, K] (gated: N = 2I);
    BARRIER >= 0: after grid barrier ``BARRIER``, PREFETCH K steps of the first tile loaded
    before its wait."""
    pid, progs = tl.program_id(0), tl.num_programs(0)
    KS: tl.constexpr = K // BLOCK_K  # K steps a tile
    if EPI == _GATED:
        n_tiles = tl.cdiv(NI, BLOCK_N // 2)
    else:
        n_tiles = tl.cdiv(N, BLOCK_N)
    t0, t1 = pid * n_tiles // progs, (pid + 1) * n_tiles // progs  # this program's tiles
    acc = _acc0(BLOCK_N, GROUPS)
    u0 = t0 * KS  # the first (tile, K step) unit
    rows = _tile_rows(NI, BLOCK_N, EPI).to(tl.int64)[:, None] * K  # [BN, 1]
    if BARRIER >= 0:
        _arrive(Sync, BARRIER, epoch, SYNC_GROUPS)
        if L2_STEPS > 0:  # GPU only: the next L2_STEPS K steps of t0 into L2 (bulk, a row each)
            if t0 < t1:
                base = W + _tile_start(t0, N, NI, BLOCK_N, EPI).to(tl.int64) * K
                rows1 = _tile_rows(NI, BLOCK_N, EPI).to(tl.int64) * K
                _prefetch_rows(base + rows1 + PREFETCH * BLOCK_K,
                               tl.full([BLOCK_N], L2_STEPS * BLOCK_K, tl.int32))  # fmt: skip
        if PREFETCH > 0:  # in flight during the wait: [BN, PREFETCH BK], K steps 0.. of t0
            base = W + _tile_start(t0, N, NI, BLOCK_N, EPI).to(tl.int64) * K
            w_pre = tl.load(base + rows + tl.arange(0, PREFETCH * BLOCK_K)[None, :])
        _wait(Sync + BARRIER, target, Status, spin_limit, FENCE, POLL1)
        if PREFETCH > 0:
            acc = _dot_step(acc, w_pre, X, 0, X_CG, GROUPS)
            u0 += PREFETCH
            if PREFETCH == KS:  # the first tile is done
                if t0 < t1:
                    _store_tile(acc, t0, S, Y, Res, N, NI, BLOCK_N, EPI)
                acc = _acc0(BLOCK_N, GROUPS)
    offs_k = tl.arange(0, BLOCK_K)
    for u in tl.range(u0, t1 * KS, num_stages=NUM_STAGES):
        tile, ks = u // KS, u % KS
        base = W + (_tile_start(tile, N, NI, BLOCK_N, EPI).to(tl.int64) * K + ks * BLOCK_K)
        w = tl.load(base + rows + offs_k[None, :], eviction_policy="evict_first")
        acc = _dot_step(acc, w, X, ks * BLOCK_K, X_CG, GROUPS)
        if ks == KS - 1:
            _store_tile(acc, tile, S, Y, Res, N, NI, BLOCK_N, EPI)
            acc = _acc0(BLOCK_N, GROUPS)


@triton.jit
def _chain_enter(Wqkv, NQ: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Launched while the layer before runs (PDL, ``chain=True``): this program's first qkv
    tile into L2 (weights depend on nothing: bulk prefetches, a row each), then wait for that
    layer (its output, this layer's x, and its epoch are then visible), then let the next
    layer launch. Its programs wait for this one's at their own entry, so no program of a
    layer waits at a grid barrier for one that cannot be resident yet: a layer's programs
    all run (or have ended) before the next launches."""
    t0 = tl.program_id(0) * tl.cdiv(NQ, BLOCK_N) // tl.num_programs(0)
    rows = _tile_start(t0, NQ, 0, BLOCK_N, _PLAIN) + tl.arange(0, BLOCK_N)
    _prefetch_rows(Wqkv + rows.to(tl.int64) * H, tl.full([BLOCK_N], H, tl.int32))
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _layer_chain_kernel(
    X,  # [H] the layer's input (fp16/bf16)
    Wqkv, Sqkv,  # [NQ, H] e4m3, [NQ] fp32
    Wo, So,  # [H, H], [H]
    Wgu, Sgu,  # [2I, H] ([gate; up]), [2I]
    Wd, Sd,  # [H, NI], [H]
    Qkv, R1, Hid, Out,  # [NQ], [H], [NI], [H] in X's dtype
    Sync,  # [4 + 3 SYNC_GROUPS] int32: arrivals at barriers 0-2, the epoch, groups' counts
    Status,  # [1] int32: waits that timed out
    spin_limit,
    NQ: tl.constexpr, H: tl.constexpr, NI: tl.constexpr,
    BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,  # rows
    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,  # K steps loaded before each wait (0: none)
    GROUPS: tl.constexpr,  # the tile's rows in this many batched dots (_dot_step)
    CHAIN: tl.constexpr = False,  # launched early (PDL): wait in-kernel for the layer before
    FENCE: tl.constexpr = True,  # the waits' acquire fence (PTX: not in the interpreter)
    SYNC_GROUPS: tl.constexpr = 1,  # two-level barriers over this many groups (_arrive)
    POLL1: tl.constexpr = False,  # one thread a program polls (_wait; PTX: GPU only)
    L2_STEPS: tl.constexpr = 0,  # K steps of a phase's first tile asked of L2 at each arrival
):  # fmt: skip
    """One decode layer's four GEMVs (module doc), one program an SM, barriers between."""
    if CHAIN:
        _chain_enter(Wqkv, NQ, H, BN_QKV)
    epoch = tl.load(Sync + 3, cache_modifier=".cg")
    if SYNC_GROUPS == 1:  # every barrier's count when all arrived
        target = (epoch + 1) * tl.num_programs(0)
    else:  # groups that have programs
        target = (epoch + 1) * tl.minimum(tl.num_programs(0), SYNC_GROUPS)
    # a: qkv = S_qkv (Q_qkv @ x)
    _phase(X, Wqkv, Sqkv, Qkv, X, Sync, epoch, target, Status, spin_limit,
           NQ, NI, H, -1, _PLAIN, False, BN_QKV, BLOCK_K, NUM_STAGES, PREFETCH,
           GROUPS, FENCE, SYNC_GROUPS, POLL1, L2_STEPS)  # fmt: skip
    # c: r1 = x + S_o (Q_o @ qkv[:H])
    _phase(Qkv, Wo, So, R1, X, Sync, epoch, target, Status, spin_limit,
           H, NI, H, 0, _RESIDUAL, True, BN_O, BLOCK_K, NUM_STAGES, PREFETCH,
           GROUPS, FENCE, SYNC_GROUPS, POLL1, L2_STEPS)  # fmt: skip
    if tl.program_id(0) == 0:  # past barrier 0: every program has read the epoch
        tl.store(Sync + 3, epoch + 1)
    # e: h = silu(g) u, [g; u] = S_gu (Q_gu @ r1)
    _phase(R1, Wgu, Sgu, Hid, X, Sync, epoch, target, Status, spin_limit,
           2 * NI, NI, H, 1, _GATED, True, BN_GU, BLOCK_K, NUM_STAGES, PREFETCH,
           GROUPS, FENCE, SYNC_GROUPS, POLL1, L2_STEPS)  # fmt: skip
    # g: out = r1 + S_d (Q_d @ h)
    _phase(Hid, Wd, Sd, Out, R1, Sync, epoch, target, Status, spin_limit,
           H, NI, NI, 2, _RESIDUAL, True, BN_D, BLOCK_K, NUM_STAGES, PREFETCH,
           GROUPS, FENCE, SYNC_GROUPS, POLL1, L2_STEPS)  # fmt: skip


# ---------------------------------------------------------------- launcher


@dataclasses.dataclass(frozen=True)
class ChainTiles:
    """The kernel's tile: BLOCK_N weight rows x BLOCK_K columns a K step (diag: BLOCK_K / 8
    >= 16, the dot's K), warps, pipeline stages, the K steps prefetched before each wait (with
    ``prefetch=True``), and the row groups of the dot (``_dot_step``; num_warps: one a warp);
    then ``balance``: 0, or a phase's rows a tile halved (down to ``min_rows``) while its
    busiest SM has more than (100 + balance)% of the mean's weight bytes (``phase_rows``);
    ``sync_groups``: the barriers' groups (``_arrive``); ``poll1``: one thread polls
    (``_wait``); ``l2_steps``: at each arrival, the K steps after the prefetched ones of the
    program's first tile of the next phase asked of L2 (sm_90's bulk prefetch; GPU only)."""

    block_n: int = 16
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 4
    prefetch_steps: int = 1
    groups: int = 4
    balance: int = 0
    sync_groups: int = 1
    poll1: int = 0
    l2_steps: int = 0

    def __post_init__(self):
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_n, self.block_k, self.groups))
        if not pow2 or self.block_n < 2 * self.groups or self.block_k < 128:
            raise ValueError(f"block_n {self.block_n} (>= 2 groups), block_k {self.block_k} "
                             f"(>= 128), groups {self.groups} must be powers of two")  # fmt: skip
        if self.num_warps < 1 or self.num_stages < 1 or self.prefetch_steps < 0:
            raise ValueError(f"bad tile {self}")
        if min(self.balance, self.l2_steps) < 0 or self.sync_groups < 1 or self.poll1 not in (0, 1):
            raise ValueError(f"bad tile {self}")

    @property
    def min_rows(self) -> int:
        return max(4, 2 * self.groups)

    @classmethod
    def parse(cls, text: str) -> ChainTiles:
        """``BNxBKxWARPSxSTAGESxPREFETCHxGROUPS[xBALANCE[xSYNC_GROUPSxPOLL1[xL2_STEPS]]]``,
        e.g. ``16x512x4x4x2x4`` or ``8x256x1x6x2x1x10x16x1``."""
        return cls(*(int(v) for v in text.split("x")))


def phase_rows(outputs: int, gated: bool, programs: int, sms: int, tiles: ChainTiles) -> int:
    """A phase's rows a tile: ``tiles.block_n``, halved while ``tiles.balance`` is on and the
    busiest SM (programs dealt to SMs in turn, ``p % sms``, as the launch places one wave) has
    more than (100 + balance)% of the mean's tiles, down to ``tiles.min_rows``. ``outputs``:
    the phase's output columns (gated: gate and up rows of the same outputs, BN / 2 each)."""
    bn = tiles.block_n
    while tiles.balance and bn > tiles.min_rows:
        n_tiles = -(-outputs // (bn // 2 if gated else bn))
        per_sm = [0] * min(sms, programs)
        for p in range(programs):
            per_sm[p % len(per_sm)] += (p + 1) * n_tiles // programs - p * n_tiles // programs
        if max(per_sm) * len(per_sm) <= (1 + tiles.balance / 100) * n_tiles:
            break
        bn //= 2
    return bn


_SYNC: dict = {}  # (device, programs, sync groups) -> Sync [4 + 3 groups] int32 (module doc)
_STATUS: dict = {}  # device -> [1] int32: barrier waits that timed out
_RESIDENT: dict = {}  # launch key -> the compiled kernel's facts, its grid checked


def _buffer(table: dict, key, n: int, device: torch.device) -> torch.Tensor:
    if key not in table:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("layer_chain: run it once outside CUDA-graph capture first")
        table[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return table[key]


def barrier_timeouts(device: torch.device | str) -> int:
    """Barrier waits on ``device`` that timed out so far (0: every result is good)."""
    status = _STATUS.get(torch.device(device))
    return 0 if status is None else int(status.item())


def reset_barriers(device: torch.device | str) -> None:
    """Forget ``device``'s barrier counters and status (after a timeout they disagree)."""
    device = torch.device(device)
    _STATUS.pop(device, None)
    for key in [k for k in _SYNC if k[0] == device]:
        del _SYNC[key]


def _check(x, weights, tiles: ChainTiles) -> tuple[int, int, int]:
    """(NQ, H, I) of the operands, or ValueError."""
    (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_d, s_d) = weights
    if x.dim() != 1 or x.dtype not in (torch.float16, torch.bfloat16) or x.stride(0) != 1:
        raise ValueError(f"x must be a contiguous fp16/bf16 [H] vector; got {x.dtype} "
                         f"{tuple(x.shape)}")  # fmt: skip
    h = x.shape[0]
    nq, i = w_qkv.shape[0], w_d.shape[1]
    want = {"w_qkv": (nq, h), "w_o": (h, h), "w_gu": (2 * i, h), "w_d": (h, i)}
    for (name, shape), (w, s) in zip(want.items(), weights, strict=True):
        if w.shape != shape or w.dtype != torch.float8_e4m3fn or not w.is_contiguous():
            raise ValueError(f"{name} must be contiguous float8_e4m3fn {list(shape)}; got "
                             f"{w.dtype} {list(w.shape)}")  # fmt: skip
        if s.shape != (shape[0],) or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"{name}'s scales must be contiguous float32 [{shape[0]}]; got "
                             f"{s.dtype} {list(s.shape)}")  # fmt: skip
        if w.device != x.device or s.device != x.device:
            raise ValueError(f"{name} or its scales not on x's device {x.device}")
    if nq < h:
        raise ValueError(f"qkv has {nq} rows, fewer than o_proj reads (H = {h})")
    if min(h, 2 * i) < tiles.block_n:
        raise ValueError(f"H {h} and 2I {2 * i} must be at least block_n {tiles.block_n}")
    if h % tiles.block_k or i % tiles.block_k or i == 0:
        raise ValueError(f"H {h} and I {i} must be multiples of block_k {tiles.block_k}")
    if tiles.prefetch_steps + tiles.l2_steps > min(h, i) // tiles.block_k:
        raise ValueError(f"prefetch_steps {tiles.prefetch_steps} + l2_steps {tiles.l2_steps} "
                         "> the K steps of a tile")  # fmt: skip
    return nq, h, i


def _facts(kernel, device: torch.device) -> dict:
    """Registers, spills, shared memory of a compiled kernel, and how many of its programs
    fit on one SM at once (the deadlock guard)."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    regs = warps * math.ceil(max(kernel.n_regs, 1) * 32 / 256) * 256  # a warp's, in 256s
    smem = kernel.metadata.shared + 1024  # sm_80+ reserves 1 KB a block
    per_sm = min(regs_sm // regs, smem_sm // smem, threads_sm // (32 * warps), 32)
    return {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills,
            "shared": kernel.metadata.shared, "num_warps": warps, "per_sm": per_sm,
            "sms": props.multi_processor_count}  # fmt: skip


def _launch(args: tuple, programs: int, consts: dict) -> None:
    """Launch on ``programs`` programs; on CUDA first (once per kind of launch) refuse a grid
    that cannot be resident all at once."""
    x = args[0]
    if x.is_cuda:
        key = (x.device, x.dtype, programs, tuple(sorted(consts.items())))
        if key not in _RESIDENT:
            facts = _facts(_layer_chain_kernel.warmup(*args, grid=(programs,), **consts),
                           x.device)  # fmt: skip
            if programs > facts["per_sm"] * facts["sms"]:
                raise ValueError(f"{programs} programs cannot all be resident ({facts}): the "
                                 "grid barrier would deadlock")  # fmt: skip
            _RESIDENT[key] = facts
    _layer_chain_kernel[(programs,)](*args, **consts)


def layer_chain(
    x: torch.Tensor,  # [H] fp16/bf16
    w_qkv: torch.Tensor, s_qkv: torch.Tensor,  # [NQ, H] e4m3, [NQ] fp32
    w_o: torch.Tensor, s_o: torch.Tensor,  # [H, H], [H]
    w_gu: torch.Tensor, s_gu: torch.Tensor,  # [2I, H] ([gate; up]), [2I]
    w_d: torch.Tensor, s_d: torch.Tensor,  # [H, I], [H]
    *,
    programs: int | None = None,
    prefetch: bool = True,
    spin_limit: int = SPIN_LIMIT,
    out: tuple[torch.Tensor, ...] | None = None,
    chain: bool = False,
    **tiles,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """One layer (module doc) in one launch of ``programs`` programs (default: one an SM on
    CUDA, 1 elsewhere: the interpreter runs programs one after another); ``prefetch``: the
    first K steps of each phase loaded before its barrier's wait; a wait gives up after
    ``spin_limit`` reads of its count (``barrier_timeouts``); ``chain``: launched early by
    programmatic dependent launch where the device has it (``_chain_enter``); ``tiles``:
    ``ChainTiles``' fields. Returns (qkv [NQ], r1 [H], h [I], out [H]) in x's dtype:
    ``out``'s tensors when given."""
    cfg = ChainTiles(**tiles)
    weights = ((w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_d, s_d))
    nq, h, i = _check(x, weights, cfg)
    if programs is None:
        programs = num_sms(x.device) if x.is_cuda else 1
    if programs < 1:
        raise ValueError(f"programs must be >= 1; got {programs}")
    outs = out or [torch.empty(n, dtype=x.dtype, device=x.device) for n in (nq, h, i, h)]
    if [(o.shape, o.dtype, o.device, o.is_contiguous()) for o in outs] != [
        ((n,), x.dtype, x.device, True) for n in (nq, h, i, h)
    ]:
        raise ValueError(f"out must be contiguous {x.dtype} [{nq}], [{h}], [{i}], [{h}]")
    groups = cfg.sync_groups
    sync = _buffer(_SYNC, (x.device, programs, groups), 4 + 3 * groups, x.device)
    status = _buffer(_STATUS, x.device, 1, x.device)
    sms = num_sms(x.device) if x.is_cuda else 1
    rows = {f"BN_{name}": phase_rows(n, gated, programs, sms, cfg)
            for name, n, gated in (("QKV", nq, False), ("O", h, False), ("GU", i, True),
                                   ("D", h, False))}  # fmt: skip
    consts = dict(NQ=nq, H=h, NI=i, **rows, BLOCK_K=cfg.block_k,
                  NUM_STAGES=cfg.num_stages, PREFETCH=cfg.prefetch_steps if prefetch else 0,
                  GROUPS=cfg.groups, FENCE=x.is_cuda, SYNC_GROUPS=groups,
                  POLL1=bool(cfg.poll1) and x.is_cuda, L2_STEPS=cfg.l2_steps if x.is_cuda else 0,
                  num_warps=cfg.num_warps,
                  **pdl_kwargs(x.device, chain))  # fmt: skip
    args = (x, *[t for pair in weights for t in pair], *outs, sync, status, spin_limit)
    _launch(args, programs, consts)
    return tuple(outs)


def reference(x, w_qkv, s_qkv, w_o, s_o, w_gu, s_gu, w_d, s_d, dtype=None):
    """(qkv, r1, h, out) in float64; ``dtype``: each stored output rounded to it before the
    next GEMV reads it, as the kernel reads them back."""

    def w(q, s):
        return q.double() * s.double()[:, None]

    def stored(t):
        return t if dtype is None else t.to(dtype).double()

    xd, h, i = x.double(), x.shape[0], w_d.shape[1]
    qkv = stored(w(w_qkv, s_qkv) @ xd)
    r1 = stored(xd + w(w_o, s_o) @ qkv[:h])
    gu = w(w_gu, s_gu) @ r1
    hid = stored(torch.nn.functional.silu(gu[:i]) * gu[i:])
    return qkv, r1, hid, r1 + w(w_d, s_d) @ hid


# ---------------------------------------------------------------- benchmark

MAX_ERR = 2e-2  # bf16 outputs against the float64 reference (rounding alone: ~4e-3)
# The timed chain's projections scale the rms of their input by GAIN (the scales are the
# quantizer's times GAIN / sqrt(K)): each layer's output stays ~ its input over 32 layers, in
# f16's range (gain 1 grows ~sqrt(5)x a layer). The check runs layer 0 at gain 1.
GAIN = 0.25
DEFAULT_TILES = "16x1024x4x4x1x4,16x512x4x8x2x4,32x512x4x6x2x4"  # ChainTiles.parse, a comma list


def make_layer(nq: int, h: int, i: int, device: str) -> list[torch.Tensor]:
    """Random e4m3 weights with per-row scales at gain 1, in ``layer_chain``'s order."""
    from kernels.quant import quantize_per_channel

    args = []
    for n, k in ((nq, h), (h, h), (2 * i, h), (h, i)):
        q, s = quantize_per_channel(torch.randn(n, k, device=device))
        args += [q, s / math.sqrt(k)]
    return args


def scaled(args: list[torch.Tensor], gain: float) -> list[torch.Tensor]:
    """The same weights with every scale times ``gain``."""
    return [t * gain if t.dtype == torch.float32 else t for t in args]


def four_launches(x: torch.Tensor, args: list[torch.Tensor], chain: bool = True) -> tuple:
    """(A): the layer as the engine's Triton backend runs it at batch 1 (``linear`` ->
    ``linear_add`` -> ``linear_act_and_mul`` -> ``linear_add``, here their ``linear_small_m``
    calls; no norms): 4 launches, in the PDL chain (``chain``) as in the decode graph. The
    residual adds also store their tiles' sums of squares (a few hundred bytes)."""
    from kernels.gemv import linear_small_m

    w_qkv, s_qkv, w_o, s_o, w_gu, s_gu, w_d, s_d = args
    x2, h = x.view(1, -1), x.shape[0]
    qkv = linear_small_m(x2, w_qkv, weight_scale=s_qkv, chain=chain)
    r1, _ = linear_small_m(qkv[:, :h], w_o, weight_scale=s_o, residual=x2, chain=chain)
    hid = linear_small_m(r1, w_gu, weight_scale=s_gu, act="silu", chain=chain)
    out, _ = linear_small_m(hid, w_d, weight_scale=s_d, residual=r1, chain=chain)
    return qkv[0], r1[0], hid[0], out[0]


def variants(tiles: list[ChainTiles], programs: int | None) -> dict:
    """name -> fn(x, layer args) -> (qkv, r1, h, out)."""
    out = {"A: 4 launches (PDL)": four_launches,
           "A0: 4 launches, no PDL": lambda x, a: four_launches(x, a, chain=False)}  # fmt: skip
    kinds = [("B", "prefetch", True, False), ("C", "no prefetch", False, False)]
    if pdl_wait(torch.device("cuda")):
        kinds.append(("D", "prefetch + PDL", True, True))
    for t in tiles:
        tag = "x".join(str(v) for v in dataclasses.astuple(t))
        for letter, what, pre, chain in kinds:
            out[f"{letter}: persistent {what} {tag}"] = (
                lambda x, a, t=t, pre=pre, chain=chain: layer_chain(
                    x, *a, programs=programs, prefetch=pre, chain=chain, **dataclasses.asdict(t))
            )  # fmt: skip
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return math.inf
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check_layer(fns: dict, x: torch.Tensor, args: list[torch.Tensor]) -> dict:
    """Every variant's (qkv, r1, h, out) on one layer at gain 1 against the float64 reference
    (intermediates rounded as stored); SystemExit past MAX_ERR or on a barrier timeout."""
    ref = reference(x, *args, dtype=x.dtype)
    errs = {}
    for name, fn in fns.items():
        got = fn(x, args)
        errs[name] = dict(zip(("qkv", "r1", "h", "out"), map(rel_err, got, ref), strict=True))
        print(f"  check {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs[name].items()))
        if not max(errs[name].values()) <= MAX_ERR:
            raise SystemExit(f"{name}: relative error over {MAX_ERR}: WRONG")
    if barrier_timeouts(x.device):
        raise SystemExit(f"{barrier_timeouts(x.device)} barrier waits timed out: not resident?")
    return errs


def run_chain(fn, layers: list, x: torch.Tensor) -> torch.Tensor:
    for args in layers:
        x = fn(x, args)[3]
    return x


def time_chains(fns: dict, layers: list, x: torch.Tensor, rounds: int, reps: int) -> dict:
    """µs a layer of each variant: the whole chain captured in one CUDA graph, the median of
    ``reps`` replays (``kernels.bench.graph_time``); variants alternated over ``rounds``."""
    from kernels.bench import graph_time

    times = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            us = graph_time([lambda fn=fn: run_chain(fn, layers, x)], min_calls=1, reps=reps)
            times[name].append(us / len(layers))
        print(f"  round {r}: " + ", ".join(f"{t[-1]:.2f}" for t in times.values()), flush=True)
    return times


def copy_gbs(reps: int, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy timed as the chains are (one graph, median replay), GB/s
    counting bytes read + written."""
    from kernels.bench import graph_time

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / graph_time([lambda: dst.copy_(src)], min_calls=1, reps=reps) / 1e3


def summarize(times: dict, layer_bytes: int, copy: float) -> dict:
    base = statistics.median(times["A: 4 launches (PDL)"])
    rows = {}
    for name, ts in times.items():
        us = statistics.median(ts)
        gbs = layer_bytes / us / 1e3
        rows[name] = {"us_per_layer": us, "gbs": gbs, "pct_copy": 100 * gbs / copy,
                      "speedup_vs_A": base / us, "rounds": ts}  # fmt: skip
    return rows


def print_table(rows: dict, layer_bytes: int, copy: float, copy_bench: float) -> None:
    print(f"\nweights {layer_bytes / 1e6:.1f} MB a layer (e4m3 + scales); copy {copy:,.0f} GB/s "
          f"(graph, read + write; kernels.bench.copy_bandwidth {copy_bench:,.0f})")  # fmt: skip
    print(f"{'variant':44} | {'µs/layer':>8} | {'GB/s':>6} | {'% copy':>6} | {'vs A':>5}")
    for name, r in rows.items():
        print(f"{name:44} | {r['us_per_layer']:8.2f} | {r['gbs']:6.0f} | {r['pct_copy']:6.1f} | "
              f"{r['speedup_vs_A']:5.3f}")  # fmt: skip


def bench(args) -> None:
    from kernels.bench import copy_bandwidth

    dev, nq, h, i = "cuda", args.qkv, args.hidden, args.inter
    tiles = [ChainTiles.parse(t) for t in args.tiles.split(",")]
    meta = {"device": torch.cuda.get_device_name(), "sms": num_sms(torch.device(dev)),
            "programs": args.programs or num_sms(torch.device(dev)), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "layers": args.layers,
            "shape": {"NQ": nq, "H": h, "I": i}, "gain": GAIN, "argv": sys.argv[1:]}  # fmt: skip
    print(json.dumps(meta), flush=True)
    torch.manual_seed(0)
    layers = [scaled(make_layer(nq, h, i, dev), GAIN) for _ in range(args.layers)]
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0])
    x = torch.randn(h, device=dev).to(torch.bfloat16)
    fns = variants(tiles, args.programs)
    checks = check_layer(fns, x, scaled(layers[0], 1 / GAIN))
    facts = [{"consts": dict(k[3]), **v} for k, v in _RESIDENT.items()]
    for f in facts:
        print(f"  kernel {f}")
    finals = {name: run_chain(fn, layers, x) for name, fn in fns.items()}
    a = finals["A: 4 launches (PDL)"]
    chain_err = {name: rel_err(y, a) for name, y in finals.items()}
    print(f"  {args.layers}-layer chain's output against A's: {chain_err}")
    if not max(chain_err.values()) <= MAX_ERR or barrier_timeouts(dev):
        raise SystemExit("the chains disagree, or a barrier wait timed out: WRONG")
    copy, copy_bench = copy_gbs(args.reps), copy_bandwidth()
    times = time_chains(fns, layers, x, args.rounds, args.reps)
    if barrier_timeouts(dev):
        raise SystemExit(f"{barrier_timeouts(dev)} barrier waits timed out while timing")
    rows = summarize(times, layer_bytes, copy)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "weight_bytes_per_layer": layer_bytes, "copy_gbs": copy,
                       "copy_gbs_bench": copy_bench, "checks": checks, "chain_err_vs_A": chain_err,
                       "kernels": facts, "variants": rows}, f, indent=1)  # fmt: skip
    print_table(rows, layer_bytes, copy, copy_bench)


# ---------------------------------------------------------------- sm_90 compile report


def _loads_before_waits(ptx: str) -> list[int]:
    """Global loads between each barrier's arrival (``red...release``) and its first poll
    (``ld.volatile``): the prefetch, in flight during the wait."""
    body = ptx.split(".section")[0]
    counts = []
    for part in re.split(r"red\.global\.gpu\.release", body)[1:]:
        counts.append(len(re.findall(r"\bld\.global", part.split("ld.volatile.global")[0])))
    return counts


def _steady_loops(s, kernel) -> list[int]:
    """SASS instructions of each phase's loop (innermost loops of more than 8) without the
    tile's epilogue, which the loop jumps over but at a tile's last K step."""
    code = s._sass_code(kernel)
    counts = []
    for lo, hi in sorted(b for b in s._backward_branches(code) if s._count(code, b)[0] > 8):
        body = [(a, op) for a, op in code if lo <= a <= hi]
        skipped = [0]
        for a, op in body:
            m = re.search(r"@!?P\d+ BRA (0x[0-9a-f]+)", op)
            if m and a < int(m.group(1), 16) <= hi:
                skipped.append(sum(a < b < int(m.group(1), 16) for b, _ in body))
        counts.append(len(body) - max(skipped))
    return counts


def sm90_report(tiles: list[ChainTiles], nq: int, h: int, i: int) -> None:
    """Each tile config, prefetch on and off and chained, compiled for sm_90 with
    tests/sm90_compile.py's helpers (no GPU): registers, stack, shared memory, the phases'
    loops' SASS counts (whole, and without the epilogue: ``steady_loops``, against the weight
    bytes a thread streams an iteration), the longest loop's mix per weight byte (epilogue
    included), the barriers' and the PDL chain's PTX, the loads issued before each wait;
    beside the engine's fp8 M = 1 tile (its loop has no epilogue)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import sm90_compile as s

    ptrs = {n: "*fp8e4nv" for n in ("Wqkv", "Wo", "Wgu", "Wd")}
    ptrs.update({n: "*fp32" for n in ("Sqkv", "So", "Sgu", "Sd")})
    ptrs.update({n: "*bf16" for n in ("X", "Qkv", "R1", "Hid", "Out")})
    ptrs.update(Sync="*i32", Status="*i32")
    engine = s.gemv_summary("fp8e4nv", tile=(16, 256, 1, 6), w_scale=1, diag=True)
    print(json.dumps({"variant": "engine gemv-fp8-channel-m1-diag", **engine}))
    for t in tiles:
        for pre, chain in ((t.prefetch_steps, False), (0, False), (t.prefetch_steps, True)):
            consts = dict(NQ=nq, H=h, NI=i, BLOCK_K=t.block_k, NUM_STAGES=t.num_stages,
                          PREFETCH=pre, GROUPS=t.groups, CHAIN=chain, SYNC_GROUPS=t.sync_groups,
                          POLL1=bool(t.poll1), L2_STEPS=t.l2_steps, **{f"BN_{n}": t.block_n for n in
                                                  ("QKV", "O", "GU", "D")})  # fmt: skip
            k = s._compile(_layer_chain_kernel, ptrs, consts, num_warps=t.num_warps,
                           num_stages=t.num_stages)  # fmt: skip
            per_thread = t.block_n * t.block_k // (32 * t.num_warps)
            row = {"variant": f"persistent {dataclasses.astuple(t)} prefetch {pre}"
                              + " chain" * chain,
                   "shared": k.metadata.shared, **s.resources(k),
                   "inner_loops": s.inner_loops(k), "steady_loops": _steady_loops(s, k),
                   "weight_bytes_a_thread": per_thread, "loop": s.loop_mix(k, per_thread),
                   **s.ptx_sync(k), **(s.pdl_order(k) if chain else {}),
                   "loads_before_waits": _loads_before_waits(k.asm["ptx"])}  # fmt: skip
            print(json.dumps(row), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--tiles", default=DEFAULT_TILES,
                    help="comma list of BNxBKxWARPSxSTAGESxPREFETCHxGROUPS")  # fmt: skip
    ap.add_argument("--programs", type=int, help="persistent grid (default: one an SM)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="graph replays a timing")
    ap.add_argument("--qkv", type=int, default=6144)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=14336)
    ap.add_argument("--sm90-report", action="store_true",
                    help="compile for sm_90, print resources and loop mixes (no GPU)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.sm90_report:
        sm90_report([ChainTiles.parse(t) for t in args.tiles.split(",")], args.qkv,
                    args.hidden, args.inter)  # fmt: skip
    else:
        bench(args)


if __name__ == "__main__":
    main()
