"""Attention metadata (built once per step, shared by every layer) and the typed backends.

A step's tokens are flattened: first the *decode* tokens (sequences that compute exactly one
token this step, one per sequence), then the *prefill* tokens (chunks of two or more tokens per
sequence). Each part goes to its own kernel; both read K/V from the paged cache after this
step's K/V have been written into it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels.common import table_columns

if TYPE_CHECKING:  # the engine imports this module; these only type its hooks
    from flashserve.engine.staging import Spec, Upload
    from flashserve.engine.step_plan import StepPlan


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
    "linear_add",
    "rms_norm",
    "add_rms_norm",
    "norm_add_norm",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "linear_act_and_mul",
    "rope_write_kv",
    "decode_attention",
    "prefill_attention",
)
Op = Callable[..., Any]


class AttentionBackend(ABC):
    """The operations the model calls, the metadata its attention reads, and the hooks that let
    a captured CUDA graph read that metadata (as mini-sglang's backends do).

    ``AttentionMetadata`` is built here and nowhere else: ``prepare_metadata`` for a step run
    eagerly (its arrays join the step's one upload), ``capture_metadata`` over the static
    buffers that ``graph_buffers`` describes, and ``replay_metadata`` writes a step's values
    into those buffers, in the step's upload, before a replay.
    """

    name: str
    # (x [T, K], weight [N, K], bias [N] | None, weight_scale=None, norm: RowNorm = None)
    # -> [T, N]; with ``norm`` the product of x RMSNormed from the row sums it carries
    linear: Op
    # (x, weight, bias, weight_scale, residual [T, N]) -> (residual + linear(x), sumsq [T, P]):
    # a sublayer's last projection added to the stream, the next norm's sums beside it
    linear_add: Op
    rms_norm: Op  # (x [T, H], weight [H], eps, unit_offset=False) -> [T, H]
    add_rms_norm: Op  # (x, residual, weight, eps, unit_offset=False) -> (normed, new residual)
    # (x, residual, post_weight, weight, eps, unit_offset=False) -> (normed, new residual):
    # x normed by post_weight before the add (Gemma's sandwich norms)
    norm_add_norm: Op
    silu_and_mul: Op  # [T, 2I] -> [T, I]
    gelu_tanh_and_mul: Op  # [T, 2I] -> [T, I]
    # (x [T, K], weight [2I, K] = [gate; up], bias, weight_scale, act, norm=None) -> [T, I]:
    # the gated MLP's projection and activation (act "silu" or "gelu_tanh"), where a backend
    # may fuse
    linear_act_and_mul: Op
    # (qkv, positions, cos, sin, k_cache, v_cache, slots, hq, hkv, q_norm=None, k_norm=None,
    #  norm_eps=1e-6, norm_unit_offset=False, *, k_scale=None, v_scale=None) -> q [T, Hq, D]
    rope_write_kv: Op
    decode_attention: Op  # one query token per sequence over its paged KV
    prefill_attention: Op  # causal chunks over their cached context plus themselves
    # An fp8 KV cache (float8_e4m3fn pools, kernels.kv_quant) comes with its scale pools: the
    # three ops above take them as k_scale=, v_scale= (quantized where written, dequantized
    # as read); other caches are called without them.

    def __init__(self) -> None:
        for op, fn in self._ops().items():
            setattr(self, op, fn)
        missing = [op for op in BACKEND_OPS if not callable(getattr(self, op, None))]
        if missing:
            raise TypeError(f"{type(self).__name__} lacks {', '.join(missing)}")

    @abstractmethod
    def _ops(self) -> dict[str, Op]:
        """Each of ``BACKEND_OPS``, by name (imported here: the kernels load on first use)."""

    def fuses_norms(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether a step of activations ``x`` [T, hidden] should leave each norm between two
        projections (of weights like ``weight``) to them: the first adds to the residual
        stream (``linear_add``), the second norms as it reads (``norm=``), and the norm's own
        op is not called. False unless the backend says (both ways compute the same values)."""
        return False

    # ---- metadata ------------------------------------------------------------------------

    def prepare_metadata(self, plan: StepPlan, upload: Upload,
                         mixed_decode_len: int = 0) -> AttentionMetadata:  # fmt: skip
        """The metadata of a step run eagerly: its slots, KV lengths, block tables ([B, W],
        zero padded) and the prefill part's query offsets go into ``upload``. Nothing in it
        makes a kernel compile again for a new step's shape: W is a multiple of 16
        (``kernels.common.table_columns``), the decodes' and the prefill part's lengths are
        two uploads (each 16-byte aligned), and in a step that mixes decodes with prefill
        chunks the decodes' length hint is ``mixed_decode_len`` where it is given (the decode
        graphs' ``max_model_len``: their kernels' split plans, compiled at the capture; the
        decode kernel reads each row's real length)."""
        nd, b = plan.num_decodes, plan.batch_size
        cu = None
        longest = max(plan.seq_lens[:nd], default=0)
        if b > nd:
            offsets = np.zeros(b - nd + 1, dtype=np.int32)  # [Bp + 1]
            np.cumsum(plan.q_lens[nd:], out=offsets[1:])
            cu = upload.add(offsets, torch.int32)
            if nd and mixed_decode_len:
                longest = max(longest, mixed_decode_len)
        return _metadata(
            slots=upload.add(plan.slot_mapping, torch.int64),
            decode_lens=upload.add(plan.seq_lens[:nd], torch.int32) if nd else None,
            prefill_lens=upload.add(plan.seq_lens[nd:], torch.int32) if b > nd else None,
            tables=upload.add_rows(plan.block_tables, table_columns(plan.table_width)),
            cu=cu,
            num_decodes=nd,
            max_decode_seq_len=longest,
            max_query_len=max(plan.q_lens[nd:], default=0),
            max_prefill_seq_len=max(plan.seq_lens[nd:], default=0),
        )

    def graph_buffers(self, max_batch: int, max_blocks: int) -> dict[str, Spec]:
        """The static buffers that captured decode steps read their metadata from: shapes
        and dtypes, by name (the graph runner allocates them in its staging)."""
        return {
            "slot_mapping": ((max_batch,), torch.int64),
            "seq_lens": ((max_batch,), torch.int32),
            "block_tables": ((max_batch, max_blocks), torch.int32),
        }

    def capture_metadata(self, buffers: dict[str, torch.Tensor], batch: int,
                         max_seq_len: int) -> AttentionMetadata:  # fmt: skip
        """The metadata a decode of ``batch`` rows is captured with: views of the static
        ``buffers``. The kernels read each row's KV length from device memory at replay;
        ``max_seq_len`` (the longest possible) only sizes their split-KV grid."""
        return _metadata(
            slots=buffers["slot_mapping"][:batch],
            decode_lens=buffers["seq_lens"][:batch],
            prefill_lens=None,
            tables=buffers["block_tables"][:batch],
            cu=None,
            num_decodes=batch,
            max_decode_seq_len=max_seq_len,
            max_query_len=0,
            max_prefill_seq_len=0,
        )

    def replay_metadata(self, plan: StepPlan, bucket: int, upload: Upload) -> None:
        """Write a decode step's metadata into the static buffers, through ``upload``: rows
        past the step's batch, up to the captured ``bucket``, are padding with slot -1
        (nothing stored) and KV length 1 (their table rows keep earlier, valid block ids)."""
        pad = bucket - plan.batch_size
        upload.put("slot_mapping", plan.slot_mapping + [-1] * pad)
        upload.put("seq_lens", plan.seq_lens + [1] * pad)
        upload.put_rows("block_tables", plan.block_tables, plan.table_width)


class TorchBackend(AttentionBackend):
    """``kernels.reference``: plain torch, rounding as Hugging Face does; runs on the CPU."""

    name = "torch"

    def __init__(self, fuse_norms: bool = False) -> None:
        self.fuse_norms = fuse_norms  # the fused ops' plain versions (tests of the model's path)
        super().__init__()

    def fuses_norms(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.fuse_norms

    def _ops(self) -> dict[str, Op]:
        from kernels import reference

        return {op: getattr(reference, op) for op in BACKEND_OPS}


class TritonBackend(AttentionBackend):
    """Attention on the Triton kernels; the small operations around it fused (RMSNorm with
    the residual add, and with Gemma's output norm before it; RoPE with the KV store, SiLU
    with the multiply), one launch each, and linear layers at decode batch sizes on the
    weight-streaming kernel, the gated MLP's activation in its epilogue there."""

    name = "triton"

    def __init__(self, pdl_chain: bool = True, prefill_path: str = "portable",
                 fuse_norms: bool = True) -> None:  # fmt: skip
        self.pdl_chain = pdl_chain  # read by _ops, which the base class calls
        self.prefill_path = prefill_path
        self.fuse_norms = fuse_norms
        super().__init__()

    def fuses_norms(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Where the GEMVs stream 16-bit or float8 weights at decode batch sizes on CUDA (measured:
        ``kernels.gemv.fuses_norms``)."""
        from kernels.gemv import fuses_norms

        return self.fuse_norms and fuses_norms(x, weight)

    def _ops(self) -> dict[str, Op]:
        from kernels.activation import gelu_tanh_and_mul, silu_and_mul
        from kernels.decode import decode_attention
        from kernels.gemv import linear, linear_act_and_mul, linear_add
        from kernels.norm import add_rms_norm, norm_add_norm, rms_norm
        from kernels.prefill import prefill_attention
        from kernels.rope import rope_write_kv

        chained = {"linear": linear, "linear_add": linear_add, "rms_norm": rms_norm,
                   "add_rms_norm": add_rms_norm,
                   "norm_add_norm": norm_add_norm, "silu_and_mul": silu_and_mul,
                   "gelu_tanh_and_mul": gelu_tanh_and_mul, "rope_write_kv": rope_write_kv,
                   "decode_attention": decode_attention,
                   "linear_act_and_mul": linear_act_and_mul}  # fmt: skip
        ops = {name: partial(fn, chain=self.pdl_chain) for name, fn in chained.items()}
        return {**ops, "prefill_attention": partial(prefill_attention, path=self.prefill_path)}

    def use_fp8_prefill_scratch(self, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Two 16-bit pools that the prefill kernel may dequantize an fp8 cache's pages into,
        to read them with the Gluon kernel (``kernels.prefill``'s ``fp8_scratch``)."""
        self.prefill_attention = partial(self.prefill_attention, fp8_scratch=scratch)


BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "triton": TritonBackend}


def load_backend(name: str, pdl_chain: bool = True, prefill_path: str = "portable"
                 ) -> AttentionBackend:  # fmt: skip
    """The backend called ``name``: ``torch`` or ``triton``. ``pdl_chain``: the triton kernels
    of a decode layer join the PDL chain (``EngineConfig.pdl_chain``); ``prefill_path``: the
    triton prefill kernel's (``EngineConfig.prefill_path``)."""
    if name == "triton":
        return TritonBackend(pdl_chain, prefill_path)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (torch or triton)")
    return BACKENDS[name]()


def _metadata(*, slots: torch.Tensor, decode_lens: torch.Tensor | None,
              prefill_lens: torch.Tensor | None, tables: torch.Tensor, cu: torch.Tensor | None,
              num_decodes: int, max_decode_seq_len: int, max_query_len: int,
              max_prefill_seq_len: int) -> AttentionMetadata:  # fmt: skip
    """A step's metadata: its [B, M] tables split at ``num_decodes`` into the decode part and
    the prefill part (views, no copies), and each part's [B] lengths."""
    nd = num_decodes
    prefill = cu is not None
    return AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=nd,
        decode_seq_lens=decode_lens,
        decode_block_tables=tables[:nd] if nd else None,
        max_decode_seq_len=max_decode_seq_len,
        num_prefill_tokens=slots.shape[0] - nd,
        prefill_cu_seqlens_q=cu,
        prefill_seq_lens=prefill_lens,
        prefill_block_tables=tables[nd:] if prefill else None,
        max_prefill_query_len=max_query_len,
        max_prefill_seq_len=max_prefill_seq_len,
    )


class PagedAttention:
    """Attention of one layer over its paged KV cache, with the backend chosen at start-up:
    RoPE (with q/k head norms when given) and the KV store, then the decode and prefill
    kernels with this layer's window and soft-cap. The cache is the layer's (k, v) pools, or
    (k, v, k_scale, v_scale) for an fp8 cache."""

    def __init__(self, backend: AttentionBackend, num_heads: int, num_kv_heads: int,
                 scale: float, window: int = 0, softcap: float = 0.0, norm_eps: float = 1e-6,
                 norm_unit_offset: bool = False):  # fmt: skip
        self.ops = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.window = window  # > 0: a sliding window of this many tokens (this layer's)
        self.softcap = softcap  # > 0: attention logit soft-capping
        self.norm_eps = norm_eps  # of the q/k head norms, when a call passes them
        self.norm_unit_offset = norm_unit_offset  # they are Gemma's (1 + w) norms

    def __call__(
        self,
        qkv: torch.Tensor,  # [T, (Hq + 2 Hkv) * D], the fused projection before RoPE
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],  # this layer's cos, sin tables, [P, R/2] each
        kv_cache: tuple[torch.Tensor, ...],  # k, v [N, BS, Hkv, D] (+ k_scale, v_scale fp8)
        meta: AttentionMetadata,
        q_norm: torch.Tensor | None = None,  # [D]: RMSNorm each query head before RoPE
        k_norm: torch.Tensor | None = None,  # [D]: and each key head (Qwen3, Gemma 3)
    ) -> torch.Tensor:  # [T, Hq, D]
        k_cache, v_cache, *scales = kv_cache
        norms = {}  # passed only when present: kernels without head norms need not take them
        if q_norm is not None:
            norms = dict(q_norm=q_norm, k_norm=k_norm, norm_eps=self.norm_eps,
                         norm_unit_offset=self.norm_unit_offset)  # fmt: skip
        fp8 = dict(zip(("k_scale", "v_scale"), scales))  # {} unless the cache is fp8
        q = self.ops.rope_write_kv(
            qkv, positions, *rope, k_cache, v_cache, meta.slot_mapping,
            self.num_heads, self.num_kv_heads, **norms, **fp8,
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
                window=self.window,
                softcap=self.softcap,
                **fp8,
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
                window=self.window,
                softcap=self.softcap,
                **fp8,
            )
        return out
