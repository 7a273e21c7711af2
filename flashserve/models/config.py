"""The shape and hyper-parameters of a decoder, read from config.json (``hf_config``) or GGUF.

One ``ModelConfig`` describes every architecture we run: the decoder
(``flashserve.models.decoder``) takes its differences from these fields alone (q/k norms,
Gemma's norms and sandwich norms, the activation, the embedding scale, soft-caps, per-layer
windows, per-layer RoPE tables, the attention scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ROPE_TYPES = ("linear", "llama3", "freq_factors", "yarn", "dynamic", "longrope")
HIDDEN_ACTS = ("silu", "gelu_tanh")
# the keys each RoPE scaling needs (``original_max_position_embeddings`` is filled in)
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "freq_factors": ("factors",),
    "yarn": ("factor",),
    "dynamic": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")  # scalings that read the pretraining length


@dataclass
class ModelConfig:
    """One decoder.

    rope_scaling: None, or a dict with ``rope_type`` one of
      - ``"linear"``: ``factor`` (positions divided by it),
      - ``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings`` (Llama 3.1 long-context frequencies),
      - ``"freq_factors"``: ``factors``, a list of ``rotary_dim // 2`` divisors of the inverse
        frequencies (how llama.cpp stores Llama 3.1 scaling: the ``rope_freqs`` tensor),
      - ``"yarn"``: ``factor``, ``original_max_position_embeddings``, optional ``beta_fast``,
        ``beta_slow``, ``attention_factor``, ``mscale``, ``mscale_all_dim``, ``truncate``,
      - ``"dynamic"``: ``factor`` (NTK base grown with the sequence, per position: see
        ``flashserve.models.rope``),
      - ``"longrope"``: ``short_factor``, ``long_factor``, ``original_max_position_embeddings``,
        optional ``factor``, ``attention_factor`` (Phi-3; which factors: ``rope``).
    attention_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
    attention_out_bias: the output projection has a bias too (Llama with ``attention_bias``).
    layer_windows: each layer's sliding window (0: full attention); empty means all full.
    hidden_act: the gated MLP's activation, ``silu`` (SwiGLU) or ``gelu_tanh`` (Gemma).
    qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    norm_unit_offset: RMSNorms scale by ``1 + w`` in float32 (Gemma).
    sandwich_norms: norms after attention and after the MLP too (Gemma 2/3: four per layer).
    embed_scale: the embeddings are multiplied by it, in the activations' dtype (Gemma:
      ``sqrt(hidden_size)``); 1.0 for none.
    query_pre_attn_scalar: attention scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None:
      ``head_dim ** -0.5``.
    attn_logit_softcap / final_logit_softcap: tanh soft-capping of the attention scores /
      of the logits (Gemma 2); 0.0 for none.
    partial_rotary_factor: RoPE turns the first ``rotary_dim`` dims of each head (Phi).
    local_rope_theta / local_rope_scaling: the RoPE of the sliding-window layers when it
      differs from the global one (Gemma 3); None: every layer uses ``rope_theta`` and
      ``rope_scaling``.
    multimodal_checkpoint: the weights are those of a multimodal checkpoint whose text model
      this is (Gemma 3): the loader maps its tensor names and skips the vision tower.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    attention_out_bias: bool = False
    layer_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"
    qk_norm: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    partial_rotary_factor: float = 1.0
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    multimodal_checkpoint: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor}")  # fmt: skip
        if self.rotary_dim % 2 or self.rotary_dim < 2:
            raise ValueError(
                f"the rotary dims (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor} = {self.rotary_dim}) must be even and >= 2"
            )
        self.layer_windows = tuple(int(w or 0) for w in self.layer_windows) or (
            (0,) * self.num_hidden_layers
        )
        if len(self.layer_windows) != self.num_hidden_layers or min(self.layer_windows) < 0:
            raise ValueError(f"layer_windows must hold num_hidden_layers ({self.num_hidden_layers})"
                             f" windows >= 0, got {self.layer_windows}")  # fmt: skip
        self.rope_scaling = normalize_rope(self.rope_scaling, self.rotary_dim,
                                           self.max_position_embeddings)  # fmt: skip
        self.local_rope_scaling = normalize_rope(self.local_rope_scaling, self.rotary_dim,
                                                 self.max_position_embeddings)  # fmt: skip

    @property
    def layer_rope(self) -> tuple[int, ...]:
        """Which RoPE table each layer reads: 0 the global one, 1 the local one (a sliding
        layer's, when ``local_rope_theta`` is set)."""
        local = self.local_rope_theta is not None
        return tuple(int(local and w > 0) for w in self.layer_windows)

    @property
    def kv_window(self) -> int:
        """The window every layer shares, so a sequence needs only its last ``kv_window``
        tokens' KV; 0 when any layer attends to the whole context."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    @property
    def rotary_dim(self) -> int:
        """The dims of a head that RoPE turns (transformers: ``int(head_dim * factor)``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """From a Hugging Face ``config.json`` (transformers 4.x or 5.x layout); the one entry
        point for config dicts (GGUF metadata is translated into one)."""
        from flashserve.models.hf_config import config_kwargs

        return cls(**config_kwargs(d, name))


def normalize_rope(
    scaling: dict[str, Any] | None, rotary_dim: int, max_positions: int
) -> dict[str, Any] | None:
    """``rope_type`` key (old configs say ``type``); None for plain RoPE; checks the keys and
    fills in ``original_max_position_embeddings`` (default: ``max_positions``)."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None)
    kind = scaling.setdefault("rope_type", kind)
    scaling.pop("rope_theta", None)
    scaling.pop("partial_rotary_factor", None)  # a field of its own
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; supported: default, {', '.join(ROPE_TYPES)}"
        )
    missing = [k for k in _ROPE_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling {kind!r} lacks {missing}")
    if kind in _ORIGINAL_LENGTH:
        scaling.setdefault("original_max_position_embeddings", max_positions)
    lists = {"freq_factors": ("factors",), "longrope": ("short_factor", "long_factor")}
    for key in lists.get(kind, ()):
        if len(scaling[key]) != rotary_dim // 2:
            raise ValueError(f"rope_scaling {kind!r}: {key} has {len(scaling[key])} values, "
                             f"the rotary dims need {rotary_dim // 2}")  # fmt: skip
    return scaling
