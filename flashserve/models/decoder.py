"""The decoder every supported architecture runs (Llama 2/3, Mistral, Qwen2/3, Gemma 2/3,
Phi-3/4, SmolLM2), as Hugging Face defines each; their differences are ``ModelConfig`` fields.

Tokens of a step are flattened to ``[T]``; every layer reads the same ``AttentionMetadata``.
q/k/v share one Linear and gate/up share another; ``load_weights`` takes Hugging Face tensor
names and copies each into its slice of the fused weight (Phi-3 checkpoints store them fused).
Every projection is a ``flashserve.models.linear.Linear``: in the model's dtype, or float8
e4m3 with scales (``Fp8Weights``); embeddings, norms and the LM head keep the model's dtype.

The residual stream travels beside the sublayers' outputs, as in vLLM: each RMSNorm that
starts a sublayer adds the previous sublayer's output to the residual first
(``add_rms_norm``), so the backend can do both in one kernel. The sums are the ones Hugging
Face computes, in the same order and dtype. Gemma's extra norms (after attention, after the
MLP) apply to a sublayer's output before that add, in the same kernel (``norm_add_norm``):
so a Gemma layer returns its MLP output un-normed and the next layer's input norm (or the
final norm) applies the layer's ``post_feedforward_layernorm`` with its own. Where the
backend folds the norms into the projections (``AttentionBackend.fuses_norms``: decode sizes,
16-bit or float8 weights, one rank, Llama's norm), the layers run ``forward_deferred``
instead: o_proj and down_proj add their outputs to the stream themselves and leave its rows'
sums of squares, and qkv_proj and gate/up norm their input as they read it
(``kernels.gemv``). The small operations (norms, RoPE with the KV store, the gated
activations) come from the attention backend (``flashserve.models.attention.AttentionBackend``):
the torch one rounds exactly as Hugging Face does; the Triton one fuses them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from flashserve.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    load_backend,
)
from flashserve.models.config import ModelConfig
from flashserve.models.linear import CHANNEL, Fp8Weights, Linear
from flashserve.models.rope import RotaryEmbedding
from flashserve.models.sharding import (
    SINGLE,
    WHOLE,
    RankShape,
    Shard,
    TPComm,
    rank_config,
    tensor_shard,
)
from flashserve.models.weights import (
    FUSED_CHECKPOINTS,
    Slot,
    check_complete,
    checkpoint_name,
    weight_slots,
)
from kernels.quant import quantize_blocks, quantize_per_channel
from kernels.reference import RowNorm

if TYPE_CHECKING:  # the Triton backend's; the model only passes it on
    from kernels.fold import AllReduceFold

_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin tables [P, R/2]


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in float32 and cast back before ``w``
    (or Gemma's ``(1 + w)``, applied in float32: ``unit_offset``); with ``residual``,
    normalises ``residual + x`` and returns that sum too; with ``post`` as well, ``x`` is
    normed by ``post`` (a sublayer's output norm, Gemma's) before that add."""

    def __init__(self, size: int, eps: float, backend: AttentionBackend | None = None,
                 unit_offset: bool = False):  # fmt: skip
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = backend or load_backend("torch")
        # passed only when set: backends whose kernels predate Gemma need not take it
        self.kwargs = {"unit_offset": True} if unit_offset else {}

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        post: RMSNorm | None = None,
        fold: AllReduceFold | None = None,  # x is this rank's part: the other's added first
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, H] (and the new residual)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps, **self.kwargs)
        kwargs = self.kwargs if fold is None else {**self.kwargs, "fold": fold}
        if post is not None:  # the same eps and form: both come from the model's config
            return self.ops.norm_add_norm(x, residual, post.weight, self.weight, self.eps,
                                          **kwargs)  # fmt: skip
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps, **kwargs)

    def deferred(self, sumsq: torch.Tensor) -> RowNorm:
        """This norm, left to the projection that reads its output: rows whose partial sums
        of squares are ``sumsq`` [T, P] (a ``Linear.add_to``'s)."""
        return RowNorm(sumsq, self.weight, self.eps)


def _norm(config: ModelConfig, backend: AttentionBackend, size: int | None = None) -> RMSNorm:
    size = size or config.hidden_size
    return RMSNorm(size, config.rms_norm_eps, backend, config.norm_unit_offset)


class Attention(nn.Module):
    """Grouped-query self-attention over the paged KV cache: this layer's window, soft-cap
    and RoPE table, q/k head norms when the config has them."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int,
                 fp8: str | None = None):  # fmt: skip
        super().__init__()
        c = config
        self.qkv_proj = Linear(c.hidden_size, c.q_size + 2 * c.kv_size, c.attention_bias,
                               backend, fp8)  # fmt: skip
        self.o_proj = Linear(c.q_size, c.hidden_size, c.attention_out_bias, backend, fp8)
        if c.architecture not in FUSED_CHECKPOINTS:  # q, k, v load apart into qkv_proj
            self.qkv_proj.check_fusable({"q_proj": c.q_size, "k_proj": c.kv_size,
                                         "v_proj": c.kv_size})  # fmt: skip
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = _norm(config, backend, config.head_dim)
            self.k_norm = _norm(config, backend, config.head_dim)
        self.rope_table = config.layer_rope[layer]  # which of the model's tables
        self.attn = PagedAttention(
            backend,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attn_scale,
            window=config.layer_windows[layer],
            softcap=config.attn_logit_softcap,
            norm_eps=config.rms_norm_eps,
            norm_unit_offset=config.norm_unit_offset,
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        ropes: list[Rope],  # the model's tables; this layer reads ropes[self.rope_table]
        kv_cache: tuple[torch.Tensor, ...],  # k, v [N, BS, Hkv, D] (+ k/v scales: fp8)
        meta: AttentionMetadata,
        fold: AllReduceFold | None = None,  # o_proj's output sent to the other rank too
    ) -> torch.Tensor:  # [T, hidden]
        return self.o_proj(self.attend(x, positions, ropes, kv_cache, meta), fold)

    def attend(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,
        ropes: list[Rope],
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
        norm: RowNorm | None = None,  # x is the residual stream: qkv_proj norms it as it reads
    ) -> torch.Tensor:  # [T, Hq * D], before o_proj
        qkv = self.qkv_proj(x, norm=norm)
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        rope = ropes[self.rope_table]
        out = self.attn(qkv, positions, rope, kv_cache, meta, *norms)  # [T, Hq, D]
        return out.view(x.shape[0], -1)


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, SiLU (SwiGLU) or GELU-tanh (Gemma); the
    fused gate/up projection and the activation are one backend op (``linear_act_and_mul``:
    the Triton backend folds the activation into the GEMV at decode batch sizes)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, fp8: str | None = None):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = Linear(hidden, 2 * inter, False, backend, fp8)
        self.down_proj = Linear(inter, hidden, False, backend, fp8)
        if config.architecture not in FUSED_CHECKPOINTS:
            self.gate_up_proj.check_fusable({"gate_proj": inter, "up_proj": inter})
        self.act = config.hidden_act  # "silu" or "gelu_tanh" (ModelConfig checks)
        self.ops = backend

    def forward(self, x: torch.Tensor, fold: AllReduceFold | None = None) -> torch.Tensor:
        return self.down_proj(self.gated(x), fold)  # [T, hidden] (fold: its output sent too)

    def gated(self, x: torch.Tensor, norm: RowNorm | None = None) -> torch.Tensor:  # [T, I]
        """``act(gate(x)) * up(x)``, before down_proj; ``norm``: x is the residual stream,
        normed as the projection reads it."""
        g = self.gate_up_proj  # [2I, hidden], gate rows first; x [T, hidden]
        kwargs = {"norm": norm} if norm is not None else {}
        return self.ops.linear_act_and_mul(x, g.weight, g.bias, g.weight_scale, self.act,
                                           **kwargs)  # fmt: skip


class DecoderLayer(nn.Module):
    """Norm, attention, norm, MLP; with ``sandwich_norms`` (Gemma) the attention and MLP
    outputs are normed too (``post_attention_layernorm``, ``post_feedforward_layernorm``)
    and the MLP's input norm is ``pre_feedforward_layernorm``. Without them the MLP's input
    norm is Llama's ``post_attention_layernorm``. The names are Hugging Face's.

    Each output norm runs in the kernel of the input norm after it (``RMSNorm``'s ``post``):
    the layer returns its MLP output un-normed and ``output_norm`` names the norm the next
    layer (or the model's final norm) must apply to it first.

    Under tensor parallelism o_proj's and down_proj's outputs are this rank's parts of sums
    over the ranks: ``tp.all_reduce`` sums them after the layer, or, with ``fold``
    (``TPComm.fold_for``: decode-sized steps, ``--tp-all-reduce fused``), the GEMV sends its
    part to the other rank and the norm that reads the output next (this layer's second norm,
    the next layer's first, the model's final one) adds the other's: every folded GEMV is
    followed by exactly one norm given the same ``fold``. The output norm (``post``) applies
    to the whole sum."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int,
                 fp8: str | None = None, *, tp: TPComm = SINGLE):  # fmt: skip
        super().__init__()
        self.tp = tp  # row-parallel o_proj and down_proj: their outputs summed over ranks
        self.input_layernorm = _norm(config, backend)
        self.self_attn = Attention(config, backend, layer, fp8)
        self.post_attention_layernorm = _norm(config, backend)
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config, backend)
            self.post_feedforward_layernorm = _norm(config, backend)
        self.mlp = MLP(config, backend, fp8)

    @property
    def output_norm(self) -> RMSNorm | None:
        """The norm this layer's output still needs (Gemma's ``post_feedforward_layernorm``),
        applied by the next norm with its own; None: the output is final."""
        return self.post_feedforward_layernorm if self.sandwich else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's MLP output, or the embeddings
        residual: torch.Tensor | None,  # [T, hidden]; None in the first layer
        positions: torch.Tensor,  # [T] int64
        ropes: list[Rope],
        kv_cache: tuple[torch.Tensor, ...],  # k, v [N, BS, Hkv, D] (+ k/v scales: fp8)
        meta: AttentionMetadata,
        post: RMSNorm | None = None,  # the previous layer's ``output_norm``, for x
        fold: AllReduceFold | None = None,  # the step's folded all-reduce (class doc)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, the residual before it
        if residual is None:  # the embeddings (replicated: whole on every rank)
            x, residual = self.input_layernorm(x), x
        else:  # the previous layer's down_proj output
            x, residual = self.input_layernorm(x, residual, post, fold)
        x = self._summed(self.self_attn(x, positions, ropes, kv_cache, meta, fold), fold)
        if self.sandwich:  # post_attention_layernorm, the add, pre_feedforward_layernorm
            x, residual = self.pre_feedforward_layernorm(x, residual,
                                                         self.post_attention_layernorm,
                                                         fold)  # fmt: skip
            # post_feedforward_layernorm: the next norm's
            return self._summed(self.mlp(x, fold), fold), residual
        x, residual = self.post_attention_layernorm(x, residual, None, fold)
        return self._summed(self.mlp(x, fold), fold), residual

    def forward_deferred(
        self,
        h: torch.Tensor,  # [T, hidden], the residual stream: the embeddings, or after a layer
        sumsq: torch.Tensor | None,  # [T, P] its rows' partial sums of squares; None: embeddings
        positions: torch.Tensor,
        ropes: list[Rope],
        kv_cache: tuple[torch.Tensor, ...],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the stream after this layer, its sums
        """``forward`` with each norm left to the projection that reads it (the backend's
        ``fuses_norms``; one rank, no sandwich norms): o_proj and down_proj add their outputs
        to the stream and leave its sums of squares, qkv_proj and gate/up norm as they read.
        The same values ``forward`` gives: the layer's output already added to the stream."""
        if sumsq is None:  # the embeddings: normed by the norm's own op
            out = self.self_attn.attend(self.input_layernorm(h), positions, ropes, kv_cache, meta)
        else:
            out = self.self_attn.attend(h, positions, ropes, kv_cache, meta,
                                        self.input_layernorm.deferred(sumsq))  # fmt: skip
        h, sumsq = self.self_attn.o_proj.add_to(out, h)
        out = self.mlp.gated(h, self.post_attention_layernorm.deferred(sumsq))
        return self.mlp.down_proj.add_to(out, h)

    def _summed(self, x: torch.Tensor, fold: AllReduceFold | None) -> torch.Tensor:
        """A row-parallel layer's output summed over the ranks now, or (``fold``) left to
        the norm that reads it."""
        return x if fold is not None else self.tp.all_reduce(x)


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, fp8: str | None = None,
                 *, tp: TPComm = SINGLE):  # fmt: skip
        super().__init__()
        # a weight given: no random init (on the meta device, nn.Embedding's normal_ imports
        # torch._dynamo, 2 s); build_model allocates it, the checkpoint fills it
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, i, fp8, tp=tp) for i in range(config.num_hidden_layers)
        )
        self.norm = _norm(config, backend)
        self.rotary_emb = RotaryEmbedding(config)  # the global layers'
        self.local_rotary_emb = None  # the sliding layers', when theirs differs (Gemma 3)
        if config.local_rope_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(config, local=True)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary_emb, self.local_rotary_emb) if r is not None]


class DecoderForCausalLM(nn.Module):
    """Decoder plus LM head; parameters never require grad. ``fp8``: the projections hold
    float8 weights as it says (the embeddings, norms and LM head keep the model's dtype).

    With ``tp`` of several ranks the model is this rank's share (``flashserve.models.sharding``):
    ``config`` is the whole model's, ``rank_config`` the shape of the share (its heads, KV
    heads, MLP width), which the layers are built with, and ``vocab`` says which rows of the
    LM head it holds; a float8 projection holds its rows or columns of the weight and the
    scales that go with them."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 fp8: Fp8Weights | None = None, *, tp: TPComm = SINGLE):  # fmt: skip
        super().__init__()
        self.config = config
        self.fp8 = fp8
        self.tp = tp
        self.rank_config = rank_config(config, tp.size)
        self.backend = attn_backend  # its metadata and graph hooks serve the model runner
        self.model = DecoderModel(self.rank_config, attn_backend, fp8.scales if fp8 else None,
                                  tp=tp)  # fmt: skip
        self.vocab = RankShape(config, tp.rank, tp.size)  # the LM head's rows on this rank
        self.lm_head = None  # tied: compute_logits uses the embedding matrix's rows
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.vocab.vocab_rows, bias=False)
        self._embed_scales: dict[torch.dtype, float] = {}
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, ...]],  # per layer: k, v (+ k/v scales: fp8)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        ropes = [(r.cos, r.sin) for r in self.model.rotary_embeddings()]
        x, residual, post = self.embed(input_ids), None, None  # [T, hidden]
        if self._defers_norms(x):
            sumsq = None
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, sumsq = layer.forward_deferred(x, sumsq, positions, ropes, kv_cache, meta)
            return self.model.norm(x)
        fold = self.tp.fold_for(x)  # decode-sized steps under --tp-all-reduce fused
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, ropes, kv_cache, meta, post, fold)
            post = layer.output_norm
        return self.model.norm(x, residual, post, fold)[0]

    def _defers_norms(self, x: torch.Tensor) -> bool:
        """Whether this step's layers leave their norms to the projections
        (``DecoderLayer.forward_deferred``): where the backend fuses them for ``x``'s size, on
        one rank (under tensor parallelism the norm sums the ranks' parts), for Llama's norm
        (not Gemma's sandwich and ``1 + w``) in the activations' dtype."""
        c = self.config
        weight = self.model.layers[0].self_attn.o_proj.weight  # the projections' dtype
        return (self.tp.size == 1 and not c.sandwich_norms and not c.norm_unit_offset
                and self.model.norm.weight.dtype == x.dtype
                and self.backend.fuses_norms(x, weight))  # fmt: skip

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The token embeddings, times ``embed_scale`` rounded to their dtype first (as
        transformers' Gemma does: sqrt(3072) is 55.5 in bf16). Every rank holds the whole
        table (``sharding``): no collective."""
        x = self.model.embed_tokens(input_ids)
        if self.config.embed_scale == 1.0:
            return x
        if x.dtype not in self._embed_scales:
            scale = torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
            self._embed_scales[x.dtype] = scale.item()
        return x * self._embed_scales[x.dtype]

    def ensure_positions(self, num_positions: int) -> None:
        """Serve positions up to ``num_positions - 1`` (the engine's max_model_len): grows
        the RoPE tables, and picks longrope's factors for that length (``rope``)."""
        for rotary in self.model.rotary_embeddings():
            rotary.resize(num_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        """float32 logits, soft-capped (``cap * tanh(logits / cap)``) when the config says;
        vocabulary-parallel: each rank's columns (a tied head: its rows of the embeddings, the
        last rank's logits padded to ``vocab_rows``), gathered (every rank gets them all), the
        padding dropped, then capped."""
        if self.lm_head is not None:
            head = self.lm_head.weight
        elif self.tp.size == 1:
            head = self.model.embed_tokens.weight
        else:  # tied: this rank's rows of the whole table, a view (none on the last rank of
            # a tiny vocabulary: its logits are all padding)
            head = self.model.embed_tokens.weight[slice(*self.vocab.vocab_range())]
        if head.shape[0]:
            logits = self.backend.linear(hidden, head).float()
        else:
            logits = hidden.new_zeros(hidden.shape[0], 0, dtype=torch.float32)
        if self.tp.size > 1:
            if logits.shape[-1] < self.vocab.vocab_rows:
                logits = F.pad(logits, (0, self.vocab.vocab_rows - logits.shape[-1]))
            logits = self.tp.gather_last_dim(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        return cap * torch.tanh(logits / cap) if cap > 0 else logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters, converting dtype and
        device on the way (a projection's float weights are quantized when the model holds
        fp8 ones: ``Linear.load``). Raises ValueError naming missing, unexpected or misshapen
        tensors. A tensor-parallel rank takes each tensor as ``tensor_shard`` cuts it: its
        part, or whole where it says so (``_quantized_whole``), cut here once quantized."""
        scale_name = self.fp8.checkpoint_scale if self.fp8 else None
        slots = self._weight_slots()
        loaded, unexpected = set(), []
        for name, tensor in weights:
            name = checkpoint_name(name, self.config)
            if name is None or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in slots:
                unexpected.append(name)
                continue
            param, start, size, linear, kind = slots[name]
            if linear is not None:
                columns = None
                if kind == "weight" and self._quantized_whole(name, tensor.dtype):
                    columns = self._rank_shard(name).take
                if linear.load(kind, tensor, start, size, name, columns) and scale_name:
                    loaded.add(name.removesuffix("weight") + scale_name)  # quantized here
            else:
                if tensor.dtype in _FLOAT8:
                    raise ValueError(f"tensor {name} is {tensor.dtype}: only the decoder's "
                                     "projections take float8 weights (embeddings, norms and "
                                     "the LM head stay unquantized)")  # fmt: skip
                dst = param.data if size is None else param.data.narrow(0, start, size)
                if dst.shape != tensor.shape:
                    raise ValueError(
                        f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(dst.shape)}"
                    )
                dst.copy_(tensor)
            loaded.add(name)
        check_complete(sorted(set(slots) - loaded), unexpected)

    def _weight_slots(self) -> dict[str, Slot]:
        """Hugging Face name -> ``Slot`` (our parameter, its rows, its projection), in this
        rank's shapes."""
        scale_name = self.fp8.checkpoint_scale if self.fp8 else None
        return weight_slots(self, self.rank_config, scale_name)

    def linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear)]

    def tensor_shard(self, name: str, shape: tuple[int, ...] | None = None,
                     dtype: torch.dtype | None = None) -> Shard:  # fmt: skip
        """What this rank reads of the checkpoint tensor (or parameter) ``name`` of ``shape``
        and ``dtype``: its part (``sharding.tensor_shard``), or all of it where the rank
        quantizes it whole (``_quantized_whole``: ``load_weights`` cuts it then). The loaders
        read only that."""
        name = checkpoint_name(name, self.config)
        if name is None:  # a tensor the model skips (a vision tower's): read as it is
            return WHOLE
        if dtype is not None and self._quantized_whole(name, dtype):
            return WHOLE
        return self._rank_shard(name, shape)

    def _rank_shard(self, name: str, shape: tuple[int, ...] | None = None) -> Shard:
        return tensor_shard(name, self.config, self.tp.rank, self.tp.size, shape)

    def _quantized_whole(self, name: str, dtype: torch.dtype) -> bool:
        """A float weight of a row-parallel projection (o_proj, down_proj) that this rank
        quantizes per channel: its scales are amaxes of whole rows, which its columns alone
        do not give, so it is read whole, quantized, then cut (its scales replicated, as an
        fp8 checkpoint's per-channel scales of a row-parallel weight are). Column-parallel
        rows and 128-column blocks quantize alike alone or whole: those are read cut."""
        return (
            self.tp.size > 1
            and self.fp8 is not None
            and self.fp8.scales == CHANNEL
            and dtype not in _FLOAT8
            and name.endswith(".weight")
            and self._rank_shard(name).dim == 1
        )


def build_model(
    config: ModelConfig,
    attn_backend: AttentionBackend,
    device: str,
    dtype: torch.dtype,
    fp8: Fp8Weights | None = None,
    *,
    tp: TPComm = SINGLE,
) -> DecoderForCausalLM:
    """A model with uninitialised weights allocated once, directly on ``device`` in ``dtype``
    (the projections' weights in float8 e4m3 and their scales in float32 with ``fp8``; the
    RoPE tables are computed); fill it with ``load_weights`` or ``init_random``. With ``tp``
    of several ranks: this rank's share only."""
    with torch.device("meta"):
        model = DecoderForCausalLM(config, attn_backend, fp8, tp=tp)
        model = model.to(dtype=dtype)
        for linear in model.linears():
            linear.set_fp8_dtypes()
    model = model.to_empty(device=device)
    for rotary in model.model.rotary_embeddings():
        rotary.build()
    return model


@torch.no_grad()
def init_random(model: DecoderForCausalLM, seed: int, std: float = 0.02) -> None:
    """Dummy weights: norms the identity (1, or 0 for Gemma's ``1 + w``), biases 0,
    everything else N(0, std), from ``seed``. A float8 projection draws its weight in the
    embeddings' dtype (the same numbers as the unquantized model's) and quantizes it. A
    rank's share draws each whole tensor, quantizes it whole where float8, and keeps its part
    (and its scales' part): the same weights whatever the tensor-parallel size."""
    device = next(model.parameters()).device
    dtype = model.model.embed_tokens.weight.dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    identity = 0.0 if model.config.norm_unit_offset else 1.0
    whole = _whole_shapes(model) if model.tp.size > 1 else {}
    fp8 = {id(m.weight): m for m in model.linears() if m.fp8 is not None}
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(identity)
        elif name.endswith(".bias"):
            p.zero_()
        elif name.endswith(".weight_scale"):
            continue  # set with its weight
        elif id(p) in fp8:
            shape = whole.get(name, tuple(p.shape))
            w = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
            linear = fp8[id(p)]
            quantize = quantize_per_channel if linear.fp8 == CHANNEL else quantize_blocks
            q, scale = quantize(w.float())
            del w
            scale_shard = model.tensor_shard(f"{name}_scale", tuple(scale.shape))
            p.copy_(model.tensor_shard(name).take(q))
            linear.weight_scale.copy_(scale_shard.take(scale))
        elif name in whole:
            w = torch.empty(whole[name], dtype=p.dtype, device=device)
            p.copy_(model.tensor_shard(name).take(w.normal_(0.0, std, generator=gen)))
        else:
            p.normal_(0.0, std, generator=gen)
    if whole and device.type == "cuda":  # the whole tensors' memory back to the device: the
        torch.cuda.empty_cache()  # KV pool is sized from what the driver reports free


def _whole_shapes(model: DecoderForCausalLM) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape in the whole (unsharded) model (its projections' weights: float8
    ones have the same shapes; their scales are not drawn)."""
    with torch.device("meta"):
        whole = DecoderForCausalLM(model.config, model.backend)
    return {name: tuple(p.shape) for name, p in whole.named_parameters()}
