"""The Llama decoder family (Llama 2/3, Mistral, Qwen2, SmolLM2), as Hugging Face defines it.

Tokens of a step are flattened to ``[T]``; every layer reads the same ``AttentionMetadata``.
q/k/v share one Linear and gate/up share another; ``load_weights`` takes Hugging Face tensor
names and copies each into its slice of the fused weight.

The residual stream travels beside the sublayers' outputs, as in vLLM: each RMSNorm adds the
previous sublayer's output to the residual first (``add_rms_norm``), so the backend can do both
in one kernel. The sums are the ones Hugging Face computes, in the same order and dtype. The
small operations (norms, RoPE with the KV store, SiLU-and-multiply) come from the attention
backend (``flashserve.models.attention.AttentionBackend``): the torch one rounds exactly as
Hugging Face does; the Triton one fuses them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashserve.models.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedAttention,
    load_backend,
)
from flashserve.models.config import ModelConfig
from flashserve.models.rope import RotaryEmbedding

# checkpoint tensors that carry no weights of ours
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in float32 and cast back before ``w``;
    with ``residual``, normalises ``residual + x`` and returns that sum too."""

    def __init__(self, size: int, eps: float, backend: AttentionBackend | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = backend or load_backend("torch")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, H] (and the new residual)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int):
        super().__init__()
        self.ops = backend
        sizes = config.q_size + 2 * config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, sizes, config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, config.attention_out_bias)
        self.attn = PagedAttention(
            backend,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim**-0.5,
            window=config.layer_windows[layer],
        )

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin tables [P, D/2]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [N, BS, Hkv, D] each
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        qkv = self.ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        out = self.attn(qkv, positions, rope, kv_cache[0], kv_cache[1], meta)  # [T, Hq, D]
        return self.ops.linear(out.view(x.shape[0], -1), self.o_proj.weight, self.o_proj.bias)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.ops = backend
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.ops.linear(x, self.gate_up_proj.weight)
        return self.ops.linear(self.ops.silu_and_mul(gate_up), self.down_proj.weight)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.self_attn = LlamaAttention(config, backend, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.mlp = LlamaMLP(config, backend)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the previous layer's MLP output, or the embeddings
        residual: torch.Tensor | None,  # [T, hidden]; None in the first layer
        positions: torch.Tensor,  # [T] int64
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin tables [P, D/2]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # [N, BS, Hkv, D] each
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # this layer's MLP output, the residual before it
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; parameters never require grad."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.backend = attn_backend  # its metadata and graph hooks serve the model runner
        self.model = LlamaModel(config, attn_backend)
        self.lm_head = None  # tied: compute_logits uses the embedding matrix
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer, [N, BS, Hkv, D] each
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        rope = (self.model.rotary_emb.cos, self.model.rotary_emb.sin)
        x, residual = self.model.embed_tokens(input_ids), None  # [T, hidden]
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, rope, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def ensure_positions(self, num_positions: int) -> None:
        """Grow the RoPE cache so positions up to ``num_positions - 1`` are valid."""
        self.model.rotary_emb.resize(num_positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, V]
        """float32 logits."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        return self.backend.linear(hidden, head.weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into our (fused) parameters, converting dtype and
        device on the way. Raises ValueError naming missing, unexpected or misshapen tensors."""
        slots = self._weight_slots()
        loaded, unexpected = set(), []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            if name not in slots:
                unexpected.append(name)
                continue
            param, start, size = slots[name]
            dst = param.data if size is None else param.data.narrow(0, start, size)
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, "
                    f"model expects {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add(name)
        _check_complete(sorted(set(slots) - loaded), unexpected)

    def _weight_slots(self) -> dict[str, tuple[nn.Parameter, int, int | None]]:
        """Hugging Face name -> (our parameter, first row, rows or None for all of it)."""
        slots = {name: (p, 0, None) for name, p in self.named_parameters()}
        c = self.config
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
            for kind in ("weight", "bias") if c.attention_bias else ("weight",):
                del slots[f"{pre}self_attn.qkv_proj.{kind}"]
                param = getattr(attn, kind)
                starts = (0, c.q_size, c.q_size + c.kv_size)
                sizes = (c.q_size, c.kv_size, c.kv_size)
                for proj, start, size in zip("qkv", starts, sizes):
                    slots[f"{pre}self_attn.{proj}_proj.{kind}"] = (param, start, size)
            del slots[f"{pre}mlp.gate_up_proj.weight"]
            inter = c.intermediate_size
            slots[f"{pre}mlp.gate_proj.weight"] = (mlp.weight, 0, inter)
            slots[f"{pre}mlp.up_proj.weight"] = (mlp.weight, inter, inter)
        return slots


def _check_complete(missing: list[str], unexpected: list[str]) -> None:
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing: {', '.join(missing[:8])}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected: {', '.join(unexpected[:8])}")
    raise ValueError("checkpoint does not match the model; " + "; ".join(parts))


def build_model(
    config: ModelConfig, attn_backend: AttentionBackend, device: str, dtype: torch.dtype
) -> LlamaForCausalLM:
    """A model with uninitialised weights allocated once, directly on ``device`` in ``dtype``
    (the RoPE cache is computed); fill it with ``load_weights`` or ``init_random``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.model.rotary_emb.build()
    return model


@torch.no_grad()
def init_random(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Dummy weights: norms 1, biases 0, everything else N(0, std), from ``seed``."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
