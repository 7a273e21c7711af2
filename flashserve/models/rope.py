"""Rotary position embedding: the cos/sin cache (the rotation itself is the backend's
``rope_write_kv``, Hugging Face's rotate-half convention)."""

from __future__ import annotations

import math

import torch
from torch import nn

from flashserve.models.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:  # [D/2] float32
    """Inverse frequencies ``theta^(-2i/D)``, rescaled as ``config.rope_scaling`` says."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling, config.max_position_embeddings)
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict, max_positions: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position_embeddings``, computed once.

    Computed in float32 and stored in the buffers' dtype (the model's), as Hugging Face casts
    cos/sin to the activations' dtype before rotating.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        shape = (config.max_position_embeddings, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)  # [P, D/2]
        self.register_buffer("sin", torch.empty(shape), persistent=False)  # [P, D/2]
        self.build()

    def resize(self, num_positions: int) -> None:
        """Cover positions up to ``num_positions`` (when serving past the trained context)."""
        if num_positions > self.cos.shape[0]:
            shape = (num_positions, self.cos.shape[1])
            self.cos = self.cos.new_empty(shape)
            self.sin = self.sin.new_empty(shape)
            self.build()

    @torch.no_grad()
    def build(self) -> None:
        """(Re)compute the cache in place, on the buffers' device (after ``to_empty``)."""
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.config).to(self.cos.device)  # [D/2]
        pos = torch.arange(self.cos.shape[0], device=self.cos.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2]
        self.cos.copy_(freqs.cos())
        self.sin.copy_(freqs.sin())
