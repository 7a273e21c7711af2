"""Rotary position embedding: the cos/sin tables (the rotation itself is the backend's
``rope_write_kv``, Hugging Face's rotate-half convention over the first ``rotary_dim`` dims).

Each scaling computes its inverse frequencies as transformers 5 does
(``modeling_rope_utils``); ``yarn`` and ``longrope`` also scale cos and sin by an attention
factor. Two scalings depend on the sequence length, and a table is per position, so they are
decided here:

- ``dynamic`` (NTK): position ``p`` is turned with the base transformers computes for a
  sequence of ``max(p + 1, max_position_embeddings)`` tokens. That is exactly transformers'
  rule for a token decoded at ``p``, and for every position of a prompt within the
  pretraining length; a prompt that itself runs past it is turned per position here, where
  transformers turns the whole prompt with the base of its final length.
- ``longrope`` (Phi-3): the long factors at every position when the positions served (the
  engine's max_model_len, ``context_len`` here) exceed ``original_max_position_embeddings``,
  else the short ones (llama.cpp's rule; transformers switches per forward on the sequence
  length). The attention factor is always transformers': from ``factor``, or
  ``max_position_embeddings / original_max_position_embeddings``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from flashserve.models.config import ModelConfig


def rope_inv_freq(
    theta: float, scaling: dict[str, Any] | None, dim: int, max_positions: int, long: bool = False
) -> tuple[torch.Tensor, float]:  # [dim/2] float32, attention factor
    """Inverse frequencies ``theta^(-2i/dim)`` rescaled as ``scaling`` says, and the factor
    that multiplies cos and sin. ``long``: longrope's long factors. ``dynamic`` gives the
    frequencies of a sequence within ``max_positions`` (``rope_table`` grows them)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    if kind == "yarn":
        return _yarn(theta, scaling, dim)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        return 1.0 / (factors.float() * theta**exponents), _longrope_factor(scaling, max_positions)
    return inv_freq, 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(theta: float, s: dict, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated (``/ factor``) low frequencies, extrapolated high ones, a linear
    ramp between the dims that turn ``beta_slow`` and ``beta_fast`` times over the original
    length; the attention factor ``0.1 ln(factor) + 1`` unless the config gives one."""
    factor, old_len = s["factor"], s["original_max_position_embeddings"]
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if (
            mscale and mscale_all) else _mscale(factor)  # fmt: skip
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_factor(s: dict, max_positions: int) -> float:
    old_len = s["original_max_position_embeddings"]
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    factor = s.get("factor") or max_positions / old_len
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))


def rope_table(
    theta: float,
    scaling: dict[str, Any] | None,
    dim: int,
    max_positions: int,
    num_positions: int,
    context_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [num_positions, dim/2] float32
    """cos and sin of every position below ``num_positions`` (``context_len``: the positions
    served, which picks longrope's factors)."""
    kind = (scaling or {}).get("rope_type")
    pos = torch.arange(num_positions, dtype=torch.float32)  # [P]
    if kind == "dynamic":
        freqs = pos[:, None] * _dynamic_inv_freq(theta, scaling, dim, max_positions, pos)
        return freqs.cos(), freqs.sin()
    long = kind == "longrope" and context_len > scaling["original_max_position_embeddings"]
    inv_freq, attention = rope_inv_freq(theta, scaling, dim, max_positions, long)
    freqs = pos[:, None] * inv_freq[None, :]  # [P, dim/2]
    return freqs.cos() * attention, freqs.sin() * attention


def _dynamic_inv_freq(
    theta: float, s: dict, dim: int, max_positions: int, pos: torch.Tensor
) -> torch.Tensor:  # [P, dim/2]
    """Each position's NTK-scaled frequencies: the base transformers computes for a sequence
    of ``p + 1`` tokens, in float32 as it does (the plain base within ``max_positions``)."""
    factor = s["factor"]
    seq_len = torch.clamp(pos + 1, min=max_positions)  # [P]
    base = theta * ((factor * seq_len / max_positions) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    scaled = 1.0 / (base[:, None] ** exponents[None, :])
    plain = (1.0 / (theta**exponents)).expand_as(scaled)
    return torch.where((pos + 1 > max_positions)[:, None], scaled, plain)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to ``max_position_embeddings`` (or more, once the engine
    serves more), for the global layers or (``local``) the sliding-window ones.

    Computed in float32 and stored in the buffers' dtype (the model's), as Hugging Face casts
    cos/sin to the activations' dtype before rotating.
    """

    def __init__(self, config: ModelConfig, local: bool = False):
        super().__init__()
        self.config = config
        self.theta = config.local_rope_theta if local else config.rope_theta
        self.scaling = config.local_rope_scaling if local else config.rope_scaling
        self.context_len = config.max_position_embeddings  # positions served
        shape = (config.max_position_embeddings, config.rotary_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)  # [P, R/2]
        self.register_buffer("sin", torch.empty(shape), persistent=False)  # [P, R/2]
        self.build()

    def resize(self, num_positions: int) -> None:
        """Serve positions below ``num_positions`` (the engine's max_model_len): the tables
        grow to cover them, and longrope's factors follow the length."""
        old_long = self._long()
        self.context_len = num_positions
        if num_positions > self.cos.shape[0]:
            shape = (num_positions, self.cos.shape[1])
            self.cos = self.cos.new_empty(shape)
            self.sin = self.sin.new_empty(shape)
            self.build()
        elif self._long() != old_long:
            self.build()

    def _long(self) -> bool:
        s = self.scaling or {}
        return s.get("rope_type") == "longrope" and (
            self.context_len > s["original_max_position_embeddings"]
        )

    @torch.no_grad()
    def build(self) -> None:
        """(Re)compute the tables in place, on the buffers' device (after ``to_empty``)."""
        if self.cos.is_meta:
            return
        c = self.config
        cos, sin = rope_table(self.theta, self.scaling, c.rotary_dim, c.max_position_embeddings,
                              self.cos.shape[0], self.context_len)  # fmt: skip
        self.cos.copy_(cos)
        self.sin.copy_(sin)
