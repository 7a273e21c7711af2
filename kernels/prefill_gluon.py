"""Causal prefill over the paged KV cache in Gluon, FlashAttention-3 style (sm_90; issue 17).

Opt-in as ``prefill_attention(..., path="gluon")`` (``kernels.prefill``: the math, the
batch layout and the paged cache are described there). Gluon (``triton.experimental.gluon``,
here as in Triton 3.6) makes explicit what Triton 3.6's compiler does not do for this loop on
sm_90: warp specialization, ``wgmma`` waits placed by hand, register reallocation. Written
without a GPU: compiled for sm_90 (``tests/sm90_compile.py``), its barrier protocol and a
consumer's arithmetic played out on the CPU (``tests/test_gluon_model.py``); not yet run.

A CTA is persistent (one per SM) and runs three partitions over the same work items (query
tile of ``BLOCK_M = 128`` queries, head, sequence; heavy tiles first, dealt boustrophedon as
on the Hopper path):

- a producer warp (``_producer``, 24 registers) that walks each item's KV tiles and issues
  two bulk tensor copies (TMA) per tile, K and V, into a ring of ``STAGES`` shared-memory
  stages. A tile is one page's run of ``BLOCK_N`` rows of the pools viewed as ``[N * PAGE,
  Hkv * D]``: row ``block_table[start // PAGE] * PAGE + start % PAGE``, column ``kv_head *
  D`` (the Hopper path's descriptors). Each stage has a K-ready and a V-ready mbarrier
  (completed by the copies' byte counts) and an empty one that both consumers arrive on.
- two consumer warpgroups (``_consumer``, 4 warps each, ``CONSUMER_REGS`` registers through
  ``setmaxnreg``), each owning 64 of the tile's 128 queries (its own Q in shared memory,
  loaded an item ahead into registers) and reading the same K/V stages. Within a warpgroup
  the loop is software-pipelined by hand: tile j's ``S = Q K^T`` is issued, then tile j-1's
  ``O += P V`` (P from registers), and only S is waited for (``warpgroup_mma_wait(1)``), so
  the softmax of tile j runs while P V of tile j-1 is on the tensor cores. With
  ``PINGPONG`` the two warpgroups take turns issuing their MMAs (an mbarrier pair): one's
  softmax runs under the other's MMAs.

Masking: a tile holding a key past the warpgroup's first query is masked (``kv <= q_pos``);
the others are not. The copies cannot be masked, so the last tile of a sequence may bring
slots past its end (anything, NaN included): the scores are masked as always, and the
consumers zero those V rows in shared memory before P V (0 * NaN is NaN).

Refused here (``gluon_refusal``; the portable and Hopper paths take them): sliding windows,
soft-capping, fp8 caches, fp32, head dims other than ``GLUON_HEAD_DIMS``, pages shorter
than the KV tile. Tuning is a ``GluonConfig`` value (``gluon_config`` picks one).
"""

from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.common import PREFILL_STEP_INTS, num_sms
from kernels.kv_quant import is_head_major
from kernels.prefill_paths import gluon_triton_refusal

try:  # Gluon as in Triton 3.6 (the GPU machine's version)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover
    HAVE_GLUON = False

_LOG2E = 1.4426950408889634
BLOCK_M = 128  # queries per work item: two consumer warpgroups of 64 (wgmma's M per warpgroup)
WG_M = 64
GLUON_HEAD_DIMS = (64, 128, 256)
GLUON_DTYPES = (torch.bfloat16, torch.float16)
SMEM = 227 << 10  # H100: shared memory per block (232,448 bytes)
SMEM_SPARE = 1 << 10  # barriers and the partitions' captured arguments: 312 bytes (sm90_compile)
# 12 warps a CTA (two consumer warpgroups, the producer's, of which 3 warps idle) and 64K
# registers: 168 per thread at launch, then setmaxnreg moves them between warpgroups; the
# first consumer (the default partition) gets what the other two leave: 3 * 168 - c - p
MAXNREG = 168


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """Tuning of the Gluon kernel: ``block_n`` keys a KV tile (<= the page), ``stages`` K/V
    stages in the ring (>= 2: a stage is released only after the next tile's S is issued),
    ``pingpong`` the two warpgroups taking turns at the tensor cores, the registers per
    thread of the consumer warpgroups and of the producer warp (``setmaxnreg``). One program
    per SM: its 12 warps at 168 registers take the whole register file."""

    block_n: int = 128
    stages: int = 2
    pingpong: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24

    def __post_init__(self):
        if self.block_n not in (16, 32, 64, 128, 256) or self.stages < 2:
            raise ValueError(f"GluonConfig: block_n a power of 2 in [16, 256], stages >= 2: {self}")
        regs = (self.consumer_regs, self.producer_regs)
        if any(r % 8 or not 24 <= r <= 256 for r in regs):
            raise ValueError(f"GluonConfig: registers multiples of 8 in [24, 256]: {self}")
        if 2 * self.consumer_regs + self.producer_regs > 3 * MAXNREG:
            raise ValueError(f"GluonConfig: 2 * consumer_regs + producer_regs > {3 * MAXNREG} "
                             f"(64K registers over 384 threads): {self}")  # fmt: skip

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Q of both warpgroups and the K/V ring (barriers and scratch not counted)."""
        return (BLOCK_M + 2 * self.stages * self.block_n) * head_dim * itemsize


def gluon_config(head_dim: int, dtype: torch.dtype, page: int) -> GluonConfig:
    """The default: 128-key tiles (64 at d256, where O takes 128 registers a thread) cut to
    the page, as many stages as shared memory holds beside Q, up to 4 (d128 page 128: 3 in
    229,736 bytes; page 64: 4 in 164,200; sm90_compile). ``python -m kernels.bench --sweep
    gluon`` on the H100 (2026-11-27, docs/benchmarks/kernels.md), µs, causal, one sequence:
    d128 page 128, 16K / 4K tokens: the default (128, 3) 3,555 / 248.5, without ping-pong
    3,734 / 255.2, (128, 2) 4,219 / 269.1, (64, 3) 4,106 / 283.5, (64, 4) 4,417 / 285.2;
    page 64: (64, 3) 4,086 / 286.7, (64, 4) 4,154 / 287.0; d64 page 64, 4K: (64, 4) 205.2;
    d256 page 64, 4K: (64, 2) 567.7, without ping-pong 565.0, (32, 4) 583.9. A 2,048-query
    chunk at the end of 32K / 64K / 128K tokens (the engine's prefill steps): 618 / 601 /
    601 TFLOP/s at the default, (128, 2) 500-530."""
    del dtype
    bn = min(128 if head_dim <= 128 else 64, page)
    stages = 2
    while stages < 4 and GluonConfig(bn, stages + 1).smem_bytes(head_dim) <= SMEM - SMEM_SPARE:
        stages += 1
    return GluonConfig(block_n=bn, stages=stages)


def gluon_refusal(q: torch.Tensor, k_cache: torch.Tensor, window: int, softcap: float, fp8: bool,
                  cfg: GluonConfig, capability: tuple[int, int] | None) -> str | None:  # fmt: skip
    """Why the Gluon kernel cannot take these inputs on a device of ``capability`` (None: not
    a CUDA device), beyond ``hopper_refusal``'s pool and descriptor checks, which it shares;
    None if it can."""
    _, page, _, d = k_cache.shape
    if not HAVE_GLUON:
        return "this Triton has no Gluon (triton.experimental.gluon)"
    if capability != (9, 0):
        return (f"the Gluon kernel is written for sm_90 (wgmma, setmaxnreg; H100/H200), not "
                f"{'a CPU tensor' if capability is None else f'sm_{capability[0]}{capability[1]}'}"
                f" (no interpreter runs Gluon in Triton 3.6)")  # fmt: skip
    if window or softcap:
        return "sliding windows and soft-capping take the portable or Hopper path"
    if fp8:
        return "fp8 caches take the portable or Hopper path"
    if is_head_major(k_cache):  # its producer addresses token rows ([N * PAGE, Hkv * D])
        return "pools of a head's rows take the portable or Hopper path"
    if q.dtype not in GLUON_DTYPES:
        return f"{q.dtype}: the Gluon kernel takes bf16 and fp16"
    if d not in GLUON_HEAD_DIMS:
        return f"head dim {d}: the Gluon kernel takes {GLUON_HEAD_DIMS}"
    if page < cfg.block_n:
        return f"page {page} < block_n {cfg.block_n}: a KV tile must lie in one page"
    if cfg.smem_bytes(d) > SMEM - SMEM_SPARE:
        return f"{cfg} needs {cfg.smem_bytes(d):,} bytes of shared memory at head dim {d}"
    return gluon_triton_refusal(triton.__version__)


def gluon_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> list:
    """The pools as ``[N * PAGE, Hkv * D]`` for bulk copies of ``[block_n, D]`` tiles, in the
    swizzled shared layout that ``wgmma`` reads (the Hopper path's view, Gluon's descriptor)."""
    from kernels.prefill import pool_view  # (kernels.prefill imports this module lazily)

    d = k_cache.shape[3]
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], _GL_DTYPES[k_cache.dtype])
    return [GluonDescriptor(x, *pool_view(x), [block_n, d], layout) for x in (k_cache, v_cache)]


if HAVE_GLUON:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
    _BM = gl.constexpr(BLOCK_M)  # a jit function reads constexpr globals only
    _WG_M = gl.constexpr(WG_M)

    @gluon.constexpr_function
    def _row_layout(head_dim):
        """Q loads and V-row zeroing: 16-byte vectors along the head dim, 4 warps."""
        lanes_d = min(head_dim // 8, 32)
        return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [4, 1], [1, 0])

    @gluon.jit
    def _work_item(wave, pid, progs, n_tiles, n_heads, n_seqs):
        """Item of this program in wave ``wave``: boustrophedon (``kernels.prefill``), heavy
        (late) query tiles first, heads fastest. Returns (item, tile, head, sequence); past
        the work (item >= n_tiles * n_heads * n_seqs) the tile is negative."""
        per_row = n_heads * n_seqs
        odd = wave % 2
        item = wave * progs + pid + odd * (progs - 1 - 2 * pid)
        return item, n_tiles - 1 - item // per_row, item % n_heads, item % per_row // n_heads

    @gluon.jit
    def _load_q(Q, CuSeqlensQ, wave, grid_args, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
        """Registers of this warpgroup's 64 queries of its item in wave ``wave`` (zeros past the
        chunk, and for a wave past the work): issued an item ahead, the load runs under the
        previous item's last P V instead of stalling both warpgroups at the item's start."""
        pid, progs, n_tiles, n_heads, n_seqs, stride_qt, stride_qh = grid_args
        layout: gl.constexpr = _row_layout(HEAD_DIM)
        item, tile, h, b = _work_item(wave, pid, progs, n_tiles, n_heads, n_seqs)
        live = item < n_tiles * n_heads * n_seqs  # (b < B even past the work: a modulo)
        q_start = gl.load(CuSeqlensQ + b)
        q_len = gl.where(live, gl.load(CuSeqlensQ + b + 1) - q_start, 0)
        offs_m = tile * _BM + WG * _WG_M + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
        rows = (q_start + offs_m).to(gl.int64)
        # bounded below too: past the work the tile is negative and q_len 0, and offs_m < q_len
        # alone let every negative offset through (rows up to 3 MiB before Q: an illegal
        # address on an H200; tests/test_gluon_model.py walks these loads)
        in_chunk = (offs_m >= 0) & (offs_m < q_len)
        return gl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                       mask=in_chunk[:, None], other=0.0)  # fmt: skip

    @gluon.jit
    def _producer(args, GROUP: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                  STAGES: gl.constexpr):  # fmt: skip
        """One warp: every KV tile of every item of this program, in the consumers' order,
        two bulk copies into the next free stage (``args``: the kernel's, as it packs them)."""
        (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, empty, CuSeqlensQ, SeqLens,
         BlockTables, stride_btb, n_tiles, n_heads, n_seqs) = args  # fmt: skip
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        n_items = n_tiles * n_heads * n_seqs
        c = 0  # tiles issued so far: stage c % STAGES, its (c // STAGES)-th use
        for wave in range(gl.cdiv(n_items, progs)):
            item, tile, h, b = _work_item(wave, pid, progs, n_tiles, n_heads, n_seqs)
            if item < n_items:
                q_len = gl.load(CuSeqlensQ + b + 1) - gl.load(CuSeqlensQ + b)
                m0 = tile * _BM
                if m0 < q_len:
                    seq_len = gl.load(SeqLens + b)
                    hi = gl.minimum(seq_len - q_len + m0 + _BM, seq_len)
                    bt = BlockTables + b.to(gl.int64) * stride_btb
                    col = (h // GROUP) * HEAD_DIM
                    # the block-table entry a tile ahead: its load overlaps the wait for a stage
                    next_row = gl.load(bt) * PAGE
                    for j in range(gl.cdiv(hi, BLOCK_N)):
                        row = next_row
                        nxt = (j + 1) * BLOCK_N
                        entry = gl.load(bt + nxt // PAGE, mask=nxt < hi, other=0)
                        next_row = entry * PAGE + nxt % PAGE
                        s = c % STAGES
                        # a fresh barrier counts as having completed the phase before 0
                        mbarrier.wait(empty.index(s), (c // STAGES & 1) ^ 1)
                        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(
                            k_desc, [row, col], k_ready.index(s), k_bufs.index(s)
                        )
                        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(
                            v_desc, [row, col], v_ready.index(s), v_bufs.index(s)
                        )
                        c += 1

    @gluon.jit
    def _take_turn(turns, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG: wait until the other warpgroup has issued its MMAs (its ``t``-th turn
        ended: warpgroup 0 goes first, its first wait passes on the fresh barrier)."""
        if PINGPONG:
            mbarrier.wait(turns.index(WG), (t & 1) ^ (1 - WG))

    @gluon.jit
    def _end_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - WG))

    @gluon.jit
    def _softmax(s, m_i, l_i, q_first, start, qk_scale, s_layout: gl.constexpr,
                 BLOCK_N: gl.constexpr):  # fmt: skip
        """Online softmax of one score tile ``s`` [64, BLOCK_N] (fp32, unscaled): masked
        causally when a key of the tile lies past the first query. Returns (P, alpha, m, l)
        with m in log2 units."""
        if start + BLOCK_N > q_first + 1:
            kv = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            q_pos = q_first + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, s_layout))
            s = gl.where(kv[None, :] <= q_pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _zero_dead_rows(v_buf, start, seq_len, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
        """V rows of slots at or past the sequence's end to 0 in shared memory (the copies
        bring whatever the pool holds there). Both warpgroups do it: same bits, no race that
        matters; the fence orders the stores before the wgmma that reads them."""
        layout: gl.constexpr = _row_layout(HEAD_DIM)
        v = v_buf.load(layout)
        rows = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        v_buf.store(gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _consumer(WG: gl.constexpr, q_smem, args, STORE_LSE: gl.constexpr,
                  PINGPONG: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """One warpgroup: queries [WG * 64, WG * 64 + 64) of each work item's tile (``args``:
        the kernel's, as the kernel packs them)."""
        (k_bufs, v_bufs, k_ready, v_ready, empty, turns, Q, CuSeqlensQ, SeqLens, Out, Lse,
         qk_scale, n_tiles, n_heads, n_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
         stride_lt, stride_lh) = args  # fmt: skip
        BLOCK_N: gl.constexpr = k_bufs.shape[1]
        HEAD_DIM: gl.constexpr = k_bufs.shape[2]
        dtype: gl.constexpr = k_bufs.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

        pid = gl.program_id(0)
        progs = gl.num_programs(0)
        n_items = n_tiles * n_heads * n_seqs
        c = 0  # KV tiles consumed: the producer's counter
        t = 0  # turns taken (PINGPONG)
        grid_args = (pid, progs, n_tiles, n_heads, n_seqs, stride_qt, stride_qh)
        # Q an item ahead, but not at d256: its 64 registers a thread beside O's 128 spill
        Q_AHEAD: gl.constexpr = HEAD_DIM <= 128
        if Q_AHEAD:
            q = _load_q(Q, CuSeqlensQ, 0, grid_args, WG, HEAD_DIM)
        for wave in range(gl.cdiv(n_items, progs)):
            item, tile, h, b = _work_item(wave, pid, progs, n_tiles, n_heads, n_seqs)
            q_start = gl.load(CuSeqlensQ + b)  # (b < B even past the work: a modulo)
            q_len = gl.load(CuSeqlensQ + b + 1) - q_start
            m0 = tile * _BM
            if (item >= n_items) | (m0 >= q_len):  # no work: the producer skips it too
                if Q_AHEAD:
                    q = _load_q(Q, CuSeqlensQ, wave + 1, grid_args, WG, HEAD_DIM)
            else:
                seq_len = gl.load(SeqLens + b)
                ctx = seq_len - q_len
                hi = gl.minimum(ctx + m0 + _BM, seq_len)
                n_kv = gl.cdiv(hi, BLOCK_N)
                w0 = m0 + WG * _WG_M  # this warpgroup's first query in the chunk
                q_first = ctx + w0  # ... and its position

                if not Q_AHEAD:
                    q = _load_q(Q, CuSeqlensQ, wave, grid_args, WG, HEAD_DIM)
                q_smem.store(q)
                fence_async_shared()
                gl.thread_barrier()

                # tile 0: S, softmax
                s = c % STAGES
                mbarrier.wait(k_ready.index(s), c // STAGES & 1)
                _take_turn(turns, t, WG, PINGPONG)
                zero_s = gl.zeros([_WG_M, BLOCK_N], gl.float32, s_layout)
                sc = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s,
                                   use_acc=False, is_async=True)  # fmt: skip
                _end_turn(turns, WG, PINGPONG)
                t += 1
                sc = warpgroup_mma_wait(0, deps=[sc])
                m_i = gl.full([_WG_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
                l_i = gl.zeros([_WG_M], gl.float32, gl.SliceLayout(1, s_layout))
                p, alpha, m_i, l_i = _softmax(sc, m_i, l_i, q_first, 0, qk_scale, s_layout,
                                              BLOCK_N)  # fmt: skip
                p = gl.convert_layout(p.to(dtype), p_layout)
                acc = gl.zeros([_WG_M, HEAD_DIM], gl.float32, o_layout)

                # tile j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together; the
                # softmax of S_j runs under P V; then O is rescaled by alpha_j
                for j in range(1, n_kv):
                    prev = s
                    s = (c + j) % STAGES
                    mbarrier.wait(k_ready.index(s), (c + j) // STAGES & 1)
                    mbarrier.wait(v_ready.index(prev), (c + j - 1) // STAGES & 1)
                    _take_turn(turns, t, WG, PINGPONG)
                    sc = warpgroup_mma(q_smem, k_bufs.index(s).permute((1, 0)), zero_s,
                                       use_acc=False, is_async=True)  # fmt: skip
                    acc = warpgroup_mma(p, v_bufs.index(prev), acc, is_async=True)
                    _end_turn(turns, WG, PINGPONG)
                    t += 1
                    sc = warpgroup_mma_wait(1, deps=[sc])
                    p_next, alpha, m_i, l_i = _softmax(sc, m_i, l_i, q_first, j * BLOCK_N,
                                                       qk_scale, s_layout, BLOCK_N)  # fmt: skip
                    acc, p = warpgroup_mma_wait(0, deps=[acc, p])
                    mbarrier.arrive(empty.index(prev))  # both K and V of tile j-1 read
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                    p = gl.convert_layout(p_next.to(dtype), p_layout)

                # the last tile's P V: slots past the sequence's end zeroed first
                last = (n_kv - 1) * BLOCK_N
                mbarrier.wait(v_ready.index(s), (c + n_kv - 1) // STAGES & 1)
                if last + BLOCK_N > seq_len:
                    _zero_dead_rows(v_bufs.index(s), last, seq_len, BLOCK_N, HEAD_DIM)
                if Q_AHEAD:  # the next item's Q, under this last P V
                    q = _load_q(Q, CuSeqlensQ, wave + 1, grid_args, WG, HEAD_DIM)
                _take_turn(turns, t, WG, PINGPONG)
                acc = warpgroup_mma(p, v_bufs.index(s), acc, is_async=True)
                _end_turn(turns, WG, PINGPONG)
                t += 1
                acc = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(empty.index(s))
                c += n_kv

                l_o = gl.convert_layout(l_i, o_rows)
                out = acc / l_o[:, None]
                offs_m = w0 + gl.arange(0, _WG_M, layout=o_rows)
                offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
                rows = (q_start + offs_m).to(gl.int64)
                live = offs_m < q_len
                gl.store(Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                         out.to(Out.dtype.element_ty), mask=live[:, None])  # fmt: skip
                if STORE_LSE:
                    lse = (gl.convert_layout(m_i, o_rows) + gl.log2(l_o)) * 0.6931471805599453
                    gl.store(Lse + rows * stride_lt + h * stride_lh, lse, mask=live)

    @gluon.jit(do_not_specialize=PREFILL_STEP_INTS)
    def _gluon_prefill_kernel(
        Q,  # [T, Hq, D]
        k_desc,  # descriptors over the pools as [N * PAGE, Hkv * D], blocks [BLOCK_N, D]
        v_desc,
        CuSeqlensQ,  # [B+1] int32
        SeqLens,  # [B] int32
        BlockTables,  # [B, M] int32
        Out,  # [T, Hq, D]
        Lse,  # [T, Hq] fp32
        qk_scale,
        n_tiles,  # query tiles of the longest chunk
        n_heads,  # Hq
        n_seqs,  # B
        stride_qt,
        stride_qh,
        stride_btb,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_lh,
        GROUP: gl.constexpr,
        PAGE: gl.constexpr,
        STORE_LSE: gl.constexpr,
        STAGES: gl.constexpr,
        PINGPONG: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
        dtype: gl.constexpr = k_desc.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_WG_M, HEAD_DIM], dtype)
        q_smem = gl.allocate_shared_memory(dtype, [2, _WG_M, HEAD_DIM], q_layout)
        k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)

        args = (k_bufs, v_bufs, k_ready, v_ready, empty, turns, Q, CuSeqlensQ, SeqLens, Out, Lse,
                qk_scale, n_tiles, n_heads, n_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
                stride_lt, stride_lh)  # fmt: skip
        loads = (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, empty, CuSeqlensQ, SeqLens,
                 BlockTables, stride_btb, n_tiles, n_heads, n_seqs)  # fmt: skip
        gl.warp_specialize(
            [
                (_consumer, (0, q_smem.index(0), args, STORE_LSE, PINGPONG, STAGES)),
                (_consumer, (1, q_smem.index(1), args, STORE_LSE, PINGPONG, STAGES)),
                (_producer, (loads, GROUP, PAGE, BLOCK_N, STAGES)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


def launch_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale: float,
                max_query_len: int, out, lse, cfg: GluonConfig) -> tuple:  # fmt: skip
    """(grid, arguments, keyword arguments) of the kernel's launch on inputs that
    ``prefill_attention`` checked and ``gluon_refusal`` accepted (``lse`` None: not written).
    Apart from ``gluon_prefill`` so that the compile test can compile this very call."""
    hq, hkv = q.shape[1], k_cache.shape[2]
    bsz = seq_lens.shape[0]
    n_tiles = triton.cdiv(max_query_len, BLOCK_M)
    k_desc, v_desc = gluon_descriptors(k_cache, v_cache, cfg.block_n)
    grid = (min(n_tiles * hq * bsz, num_sms(q.device)),)
    args = (
        q, k_desc, v_desc, cu_seqlens_q, seq_lens, block_tables, out,
        out if lse is None else lse, scale * _LOG2E, n_tiles, hq, bsz, q.stride(0), q.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        0 if lse is None else lse.stride(1),
    )  # fmt: skip
    kw = dict(
        GROUP=hq // hkv, PAGE=k_cache.shape[1], STORE_LSE=lse is not None, STAGES=cfg.stages,
        PINGPONG=cfg.pingpong, CONSUMER_REGS=cfg.consumer_regs,
        PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=MAXNREG,
    )  # fmt: skip
    return grid, args, kw


def gluon_prefill(*inputs, **kw) -> None:
    """Run the kernel: ``launch_args``'s inputs; writes ``out`` (and ``lse`` if not None)."""
    grid, args, options = launch_args(*inputs, **kw)
    _gluon_prefill_kernel[grid](*args, **options)
