"""Attention metadata (built once per step, shared by every layer) and backend dispatch.

A step's tokens are flattened: first the *decode* tokens (sequences that compute exactly one
token this step, one per sequence), then the *prefill* tokens (chunks of two or more tokens per
sequence). Each part goes to its own kernel; both read K/V from the paged cache after this
step's K/V have been written into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each token; -1: padding, not stored
    # decode part: tokens [0, num_decode_tokens), one per sequence
    num_decode_tokens: int
    decode_seq_lens: torch.Tensor | None  # [Bd] int32, KV length including the new token
    decode_block_tables: torch.Tensor | None  # [Bd, M] int32
    max_decode_seq_len: int
    # prefill part: tokens [num_decode_tokens, T)
    num_prefill_tokens: int
    prefill_cu_seqlens_q: torch.Tensor | None  # [Bp+1] int32
    prefill_seq_lens: torch.Tensor | None  # [Bp] int32, KV length including this chunk
    prefill_block_tables: torch.Tensor | None  # [Bp, M] int32
    max_prefill_query_len: int
    max_prefill_seq_len: int


# the operations a backend provides, all with the signatures of ``kernels.reference``
BACKEND_OPS = (
    "linear",
    "rms_norm",
    "add_rms_norm",
    "silu_and_mul",
    "rope_write_kv",
    "decode_attention",
    "prefill_attention",
)


def load_backend(name: str, pdl_chain: bool = True) -> SimpleNamespace:
    """A backend's operations (``BACKEND_OPS``): ``torch`` is ``kernels.reference``; ``triton``
    runs attention on its kernels, fuses the small operations around it (RMSNorm with the
    residual add, RoPE with the KV store, SiLU with the multiply), one launch each, and runs
    linear layers at decode batch sizes on its weight-streaming kernel. ``pdl_chain``: the
    triton kernels of a decode layer join the PDL chain (``EngineConfig.pdl_chain``)."""
    if name == "torch":
        from kernels import reference

        return SimpleNamespace(**{op: getattr(reference, op) for op in BACKEND_OPS})
    if name == "triton":
        from kernels.activation import silu_and_mul
        from kernels.decode import decode_attention
        from kernels.gemv import linear
        from kernels.norm import add_rms_norm, rms_norm
        from kernels.prefill import prefill_attention
        from kernels.rope import rope_write_kv

        chain = {"chain": pdl_chain}
        return SimpleNamespace(
            linear=partial(linear, **chain),
            rms_norm=partial(rms_norm, **chain),
            add_rms_norm=partial(add_rms_norm, **chain),
            silu_and_mul=partial(silu_and_mul, **chain),
            rope_write_kv=partial(rope_write_kv, **chain),
            decode_attention=partial(decode_attention, **chain),
            prefill_attention=prefill_attention,
        )
    raise ValueError(f"unknown attention backend {name!r} (torch or triton)")


class PagedAttention:
    """Attention of one layer over its paged KV cache, with the backend chosen at start-up."""

    def __init__(self, backend: SimpleNamespace, num_heads: int, num_kv_heads: int, scale: float):
        self.ops = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale

    def __call__(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], the fused projection before RoPE
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],  # the model's cos, sin tables, [P, D/2] each
        k_cache: torch.Tensor,  # [N, BS, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        q = self.ops.rope_write_kv(
            qkv, positions, *rope, k_cache, v_cache, meta.slot_mapping,
            self.num_heads, self.num_kv_heads,
        )  # fmt: skip
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            self.ops.decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_seq_lens,
                meta.decode_block_tables,
                self.scale,
                max_seq_len=meta.max_decode_seq_len,
                out=out[:nd],
            )
        if meta.num_prefill_tokens:
            self.ops.prefill_attention(
                q[nd:],
                k_cache,
                v_cache,
                meta.prefill_cu_seqlens_q,
                meta.prefill_seq_lens,
                meta.prefill_block_tables,
                self.scale,
                max_query_len=meta.max_prefill_query_len,
                max_seq_len=meta.max_prefill_seq_len,
                out=out[nd:],
            )
        return out
