"""A Hugging Face ``config.json`` dict as ``ModelConfig`` keyword arguments, read the way
transformers 5 reads it.

- Keys a file leaves out take the defaults of transformers' config class for that
  architecture (a multimodal Gemma 3 file gives only a few keys of its text model).
- RoPE parameters come in two layouts: transformers 4.x (``rope_theta`` at the top level,
  ``rope_scaling`` beside it, ``rope_local_base_freq`` for Gemma 3's local layers) and 5.x
  (``rope_parameters``, per layer type for Gemma 3). When both are present ``rope_scaling``
  wins, as in transformers.
- Which layers slide follows each architecture's config class: ``layer_types`` when the
  file has it, else Mistral and Phi-3 slide every layer (when ``sliding_window`` is set),
  Qwen2/Qwen3 the layers from ``max_window_layers`` on (only with ``use_sliding_window``),
  Gemma 2 every other layer, Gemma 3 all but every ``sliding_window_pattern``-th.
"""

from __future__ import annotations

from typing import Any

from flashserve.models.config import SUPPORTED_ARCHITECTURES

# Hugging Face `architectures` entries -> model_type, for files without model_type
_HF_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
# what some model types we do not run are, for the error message
_KNOWN_UNSUPPORTED = {
    "qwen3_moe": "Qwen3-MoE (mixture of experts)",
    "qwen2_moe": "Qwen2-MoE (mixture of experts)",
    "mixtral": "Mixtral (mixture of experts)",
    "phimoe": "Phi-3.5-MoE (mixture of experts)",
    "gpt_oss": "gpt-oss (mixture of experts, attention sinks)",
    "gemma": "Gemma 1",
    "gemma3n": "Gemma 3n",
    "phi": "Phi-1/Phi-2",
    "phi3small": "Phi-3-small",
    "granite": "Granite",
    "olmo": "OLMo",
    "olmo2": "OLMo 2",
    "qwen2_vl": "Qwen2-VL (multimodal RoPE)",
}
SUPPORTED_MODEL_TYPES = (*SUPPORTED_ARCHITECTURES, "gemma3")  # gemma3: its text model

_SHAPE = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
          "num_hidden_layers": 32, "num_attention_heads": 32}  # fmt: skip
# transformers' config-class defaults of the keys read here, per model_type
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {**_SHAPE, "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {
        **_SHAPE,
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": {
        **_SHAPE,
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
    },
    "gemma2": {
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "phi3": {
        **_SHAPE,
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128}
_DEFAULTS["gemma3_text"] = {**_DEFAULTS["gemma2"], "vocab_size": 262208,
                            "max_position_embeddings": 131072, "final_logit_softcapping": None,
                            "attn_logit_softcapping": None}  # fmt: skip
_GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def config_kwargs(d: dict[str, Any], name: str = "") -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a ``config.json`` dict; ValueError naming the
    architecture or field that is not supported."""
    multimodal = _model_type(d) == "gemma3"
    if multimodal:
        d = _gemma3_text_config(d)
    arch = _model_type(d)
    d = {**_DEFAULTS.get(arch, {}), **d}
    _refuse_unsupported(d, arch)
    gemma = arch in ("gemma2", "gemma3_text")
    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    bias = bool(d.get("attention_bias")) and arch in ("llama", "qwen3", "gemma2", "gemma3_text")
    return dict(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or hidden // heads,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bias or arch == "qwen2",  # Qwen2 always has a q/k/v bias
        attention_out_bias=bias,
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=_as_id_list(d.get("eos_token_id")),
        name=name or d.get("_name_or_path", ""),
        layer_windows=_layer_windows(d, arch),
        hidden_act=_activation(d, arch),
        qk_norm=arch in ("qwen3", "gemma3_text"),
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        embed_scale=hidden**0.5 if gemma else 1.0,
        query_pre_attn_scalar=d["query_pre_attn_scalar"] if gemma else None,
        # Gemma 3's attention never applies attn_logit_softcapping (transformers 5.23)
        attn_logit_softcap=float(d.get("attn_logit_softcapping") or 0.0) * (arch == "gemma2"),
        final_logit_softcap=float(d.get("final_logit_softcapping") or 0.0) * gemma,
        multimodal_checkpoint=multimodal,
        **_rope(d, arch),
    )


def _model_type(d: dict[str, Any]) -> str:
    arch = d.get("model_type")
    if arch is None:
        classes = [_HF_CLASSES.get(c) for c in d.get("architectures") or []]
        arch = next((c for c in classes if c), None)
    if arch not in SUPPORTED_MODEL_TYPES:
        what = f" ({_KNOWN_UNSUPPORTED[arch]})" if arch in _KNOWN_UNSUPPORTED else ""
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(
            f"unsupported model_type {arch!r}{what}; supported: {supported}, and gemma3 (its "
            "text model)"
        )
    return arch


def _gemma3_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The text model of a multimodal Gemma 3 config: its ``text_config``, with the top
    level's token ids (the ones generation uses) and embedding tying."""
    text = {"model_type": "gemma3_text", **(d.get("text_config") or {})}
    for key in ("bos_token_id", "eos_token_id", "_name_or_path"):
        if d.get(key) is not None:
            text[key] = d[key]
    text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", True))
    return text


def _refuse_unsupported(d: dict[str, Any], arch: str) -> None:
    if d.get("mlp_bias"):
        raise ValueError(f"{arch}: mlp_bias=True is not supported")
    if d.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention=True (an encoder) is not supported")


def _activation(d: dict[str, Any], arch: str) -> str:
    gemma = arch in ("gemma2", "gemma3_text")
    key = "hidden_activation" if gemma else "hidden_act"
    act = d.get(key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{arch}: {key} {act!r} is not supported; supported: "
                         f"{', '.join(_ACTIVATIONS)}")  # fmt: skip
    return _ACTIVATIONS[act]


def _layer_windows(d: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's window (0: full attention), as transformers decides which layers slide."""
    n, window = d["num_hidden_layers"], d.get("sliding_window")
    if arch in ("qwen2", "qwen3"):
        window = window if d.get("use_sliding_window") else None
        default = ["sliding_attention" if window is not None and i >= d["max_window_layers"]
                   else "full_attention" for i in range(n)]  # fmt: skip
    elif arch == "gemma2":
        default = [_LAYER_TYPES[bool((i + 1) % 2)] for i in range(n)]
    elif arch == "gemma3_text":
        pattern = d.get("sliding_window_pattern", 6)
        default = [_LAYER_TYPES[bool((i + 1) % pattern)] for i in range(n)]
    elif arch in ("mistral", "phi3"):  # their attention ignores layer_types
        return (window or 0,) * n
    else:
        return (0,) * n
    types = d.get("layer_types") or default
    bad = sorted(set(types) - set(_LAYER_TYPES))
    if bad or len(types) != n:
        raise ValueError(f"{arch}: layer_types must be {n} of {_LAYER_TYPES}, got {bad or types}")
    return tuple((window or 0) if t == "sliding_attention" else 0 for t in types)


def _rope(d: dict[str, Any], arch: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, partial_rotary_factor, and the local layers' RoPE when it
    differs from the global one."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if arch == "gemma3_text":
        full, local = _gemma3_rope(d)
    elif any(t in params for t in _LAYER_TYPES):  # 5.x, per layer type
        full, local = (_nested_rope(d, params.get(t) or {}) for t in _LAYER_TYPES)
    else:
        full = local = _flat_rope(d, params, arch)
    factor = full.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    local.pop("partial_rotary_factor", None)
    out = {"rope_theta": float(full.pop("rope_theta")), "rope_scaling": full or None,
           "partial_rotary_factor": float(factor)}  # fmt: skip
    if local is not full:
        theta = float(local.pop("rope_theta"))
        if theta != out["rope_theta"] or local != full:
            out.update(local_rope_theta=theta, local_rope_scaling=local or None)
    return out


def _flat_rope(d: dict[str, Any], params: dict[str, Any], arch: str) -> dict[str, Any]:
    rope = dict(params)
    rope["rope_theta"] = rope.get("rope_theta") or d.get("rope_theta") or 10000.0
    kind = rope.setdefault("rope_type", rope.pop("type", "default"))
    if arch == "phi3" and kind in ("su", "yarn"):  # Phi-3's old names for longrope
        kind = rope["rope_type"] = "longrope"
    # a top-level original_max_position_embeddings (Phi-3 always has one) wins
    if kind in ("llama3", "yarn", "longrope"):
        top = d.get("original_max_position_embeddings")
        if top is not None:
            rope["original_max_position_embeddings"] = top
        rope.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    return rope


def _nested_rope(d: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    rope = dict(params)
    rope["rope_theta"] = rope.get("rope_theta") or d.get("rope_theta") or 10000.0
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] in ("llama3", "yarn", "longrope"):
        rope.setdefault("original_max_position_embeddings", d["max_position_embeddings"])
    return rope


def _gemma3_rope(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma 3: a 4.x ``rope_scaling`` applies to the global layers; the local layers'
    theta is ``rope_local_base_freq`` (4.x) or ``rope_parameters["sliding_attention"]``."""
    params = d.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if d.get("rope_scaling"):
        full.update(d["rope_scaling"])
    full.setdefault("rope_theta", d.get("rope_theta") or _GEMMA3_THETA["full_attention"])
    local.setdefault(
        "rope_theta", d.get("rope_local_base_freq") or _GEMMA3_THETA["sliding_attention"]
    )
    return _nested_rope(d, full), _nested_rope(d, local)


def _as_id_list(ids: int | list[int] | None) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
