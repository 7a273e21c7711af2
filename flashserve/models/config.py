"""The shape and hyper-parameters of a Llama-family decoder, read from config.json or GGUF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("llama3", "linear", "freq_factors")
# Hugging Face `architectures` entries -> our architecture name
_HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass
class ModelConfig:
    """One Llama/Mistral/Qwen2 decoder.

    rope_scaling: None, or a dict with ``rope_type`` one of
      - ``"linear"``: ``factor`` (positions divided by it),
      - ``"llama3"``: ``factor``, ``low_freq_factor``, ``high_freq_factor``,
        ``original_max_position_embeddings`` (Llama 3.1 long-context frequencies),
      - ``"freq_factors"``: ``factors``, a list of ``head_dim // 2`` divisors of the inverse
        frequencies (how llama.cpp stores Llama 3.1 scaling: the ``rope_freqs`` tensor).
    attention_bias: q/k/v projections have a bias (Qwen2; Llama with ``attention_bias``).
    attention_out_bias: the output projection has a bias too (Llama with ``attention_bias``).
    sliding_window: recorded for Mistral v0.1; attention here is always over the full context.
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
    sliding_window: int | None = None

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
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope_scaling = _normalize_rope(self.rope_scaling, self.head_dim)

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens (a query sees its own position and
        ``window - 1`` before it); 0 for a layer with full attention."""
        return (self.sliding_window or 0,) * self.num_hidden_layers

    @property
    def kv_window(self) -> int:
        """The window every layer shares, so a sequence needs only its last ``kv_window``
        tokens' KV; 0 when any layer attends to the whole context."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> ModelConfig:
        """From a Hugging Face ``config.json`` (transformers 4.x or 5.x layout)."""
        arch = _hf_architecture(d)
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be silu, got {d['hidden_act']!r}")
        heads = d["num_attention_heads"]
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
        bias = bool(d.get("attention_bias", False))
        window = d.get("sliding_window") if arch == "mistral" else None
        if arch == "qwen2" and d.get("use_sliding_window"):
            window = d.get("sliding_window")
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bias or arch == "qwen2",  # Qwen2 always has a q/k/v bias
            attention_out_bias=bias and arch != "qwen2",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_id_list(d.get("eos_token_id")),
            name=name or d.get("_name_or_path", ""),
            sliding_window=window,
        )

    @classmethod
    def from_gguf_metadata(
        cls,
        meta: dict[str, Any],
        tensor_names: set[str],
        rope_freqs: list[float] | None = None,
        name: str = "",
    ) -> ModelConfig:
        """From GGUF key/value metadata (``{key: python value}``) and the file's tensor names.

        rope_freqs: the contents of the ``rope_freqs.weight`` tensor when the file has one.
        """
        arch = meta["general.architecture"]
        if arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported GGUF architecture {arch!r} (llama or qwen2)")
        g = lambda key, default=None: meta.get(f"{arch}.{key}", default)
        hidden, heads = g("embedding_length"), g("attention.head_count")
        head_dim = g("attention.key_length") or g("rope.dimension_count") or hidden // heads
        return cls(
            architecture=arch,
            vocab_size=_gguf_vocab_size(meta, arch),
            hidden_size=hidden,
            intermediate_size=g("feed_forward_length"),
            num_hidden_layers=g("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=g("attention.head_count_kv") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(g("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(g, rope_freqs),
            max_position_embeddings=g("context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            attention_out_bias="blk.0.attn_output.bias" in tensor_names,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_gguf_eos_ids(meta),
            name=name or meta.get("general.name", ""),
        )


def _hf_architecture(d: dict[str, Any]) -> str:
    arch = d.get("model_type")
    if arch is None:
        classes = [_HF_CLASSES.get(c) for c in d.get("architectures") or []]
        arch = next((c for c in classes if c), None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _normalize_rope(scaling: dict[str, Any] | None, head_dim: int) -> dict[str, Any] | None:
    """``rope_type`` key (old configs say ``type``); None for plain RoPE; checks the keys."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("type", None)
    kind = scaling.setdefault("rope_type", kind)
    scaling.pop("rope_theta", None)
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")
    need = {
        "linear": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "freq_factors": ("factors",),
    }[kind]
    missing = [k for k in need if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {kind!r} lacks {missing}")
    if kind == "freq_factors" and len(scaling["factors"]) != head_dim // 2:
        raise ValueError(f"rope freq factors: {len(scaling['factors'])} != head_dim/2")
    return scaling


def _as_id_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]


def _gguf_vocab_size(meta: dict[str, Any], arch: str) -> int:
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens)
    if f"{arch}.vocab_size" in meta:
        return meta[f"{arch}.vocab_size"]
    raise ValueError("GGUF file has neither tokenizer.ggml.tokens nor a vocab_size key")


def _gguf_rope_scaling(g, rope_freqs: list[float] | None) -> dict[str, Any] | None:
    if rope_freqs is not None:
        return {"rope_type": "freq_factors", "factors": list(rope_freqs)}
    kind = g("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ValueError(f"unsupported GGUF rope.scaling.type {kind!r} (linear only)")
    return {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}


def _gguf_eos_ids(meta: dict[str, Any]) -> list[int]:
    """The end-of-sequence id plus end-of-turn / end-of-message ids when present."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
