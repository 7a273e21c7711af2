"""Greedy sampling with the chosen token's log-probability, over a vocabulary split in chunks
(Triton).

``argmax`` and ``log_softmax`` over one row of a 128K vocabulary are one-block reductions in
torch (~28 µs each on an H100 at batch 1). Here stage 1 reduces chunks of each row in parallel
(max, its first index, and the sum of ``exp(x - max)``), and stage 2 merges a row's chunks: the
token is the first index of the row's maximum (as ``torch.argmax``), its log-probability
``-log(sum(exp(x - max)))`` (as ``log_softmax`` at the maximum). Both stages have fixed grids,
so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096  # vocabulary entries per stage-1 program


@triton.jit
def _chunk_kernel(
    Logits,  # [N, V] float32
    PartMax,  # [N, C] float32
    PartIdx,  # [N, C] int64
    PartSum,  # [N, C] float32
    stride_l,
    vocab,
    num_chunks,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(Logits + row * stride_l + offs, mask=offs < vocab, other=float("-inf"))
    m = tl.max(x, axis=0)
    idx = tl.min(tl.where(x == m, offs, vocab), axis=0)  # the first index of the maximum
    s = tl.sum(tl.exp(x - m), axis=0)
    out = row * num_chunks + chunk
    tl.store(PartMax + out, m)
    tl.store(PartIdx + out, idx.to(tl.int64))
    tl.store(PartSum + out, s)


@triton.jit
def _merge_kernel(
    PartMax,
    PartIdx,
    PartSum,
    TokenIds,  # [N] int64
    Logprobs,  # [N] float32
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    m = tl.load(PartMax + row * num_chunks + offs, mask=mask, other=float("-inf"))
    s = tl.load(PartSum + row * num_chunks + offs, mask=mask, other=0.0)
    idx = tl.load(PartIdx + row * num_chunks + offs, mask=mask, other=0)
    best = tl.max(m, axis=0)
    first = tl.min(tl.where(m == best, offs, BLOCK_C), axis=0)  # chunks are in vocabulary order
    token = tl.sum(tl.where(offs == first, idx, 0), axis=0)
    total = tl.sum(tl.where(mask, s * tl.exp(m - best), 0.0), axis=0)
    tl.store(TokenIds + row, token)
    tl.store(Logprobs + row, -tl.log(total))


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] float32 -> (argmax [N] int64, log_softmax at it [N] float32)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be float32 [N, V] with contiguous rows, got "
                         f"{logits.dtype} {tuple(logits.shape)}")  # fmt: skip
    n, vocab = logits.shape
    ids = torch.empty(n, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n == 0:
        return ids, logprobs
    chunks = triton.cdiv(vocab, _BLOCK)
    part_max = torch.empty((n, chunks), dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty((n, chunks), dtype=torch.int64, device=logits.device)
    _chunk_kernel[(n, chunks)](
        logits, part_max, part_idx, part_sum, logits.stride(0), vocab, chunks, BLOCK=_BLOCK,
        num_warps=8,
    )  # fmt: skip
    _merge_kernel[(n,)](
        part_max, part_idx, part_sum, ids, logprobs, chunks,
        BLOCK_C=max(16, triton.next_power_of_2(chunks)), num_warps=1,
    )  # fmt: skip
    return ids, logprobs
