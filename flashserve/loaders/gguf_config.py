"""GGUF metadata (llama.cpp's keys) translated into a Hugging Face ``config.json`` dict.

A GGUF file is a converted Hugging Face checkpoint: llama.cpp's ``convert_hf_to_gguf.py`` writes
``{arch}.*`` keys from config.json and drops what llama.cpp infers or hard-codes. This module
rebuilds the config.json (transformers 5.x layout) the converter started from, so a GGUF model
is built by ``ModelConfig.from_hf_dict`` exactly as its Hugging Face directory would be, and
transformers itself can check the translation (the tests build transformers models from it).

What llama.cpp infers, we infer the same way:
- Gemma 2 slides on even layers (``set_swa_pattern(2)``), Gemma 3 on five of every six
  (``set_swa_pattern(6)``) with a local RoPE base of 10,000 unless ``rope.freq_base_swa`` says;
- Gemma's ``query_pre_attn_scalar`` is the head dim, except hidden/heads for the 27B models
  (46 layers for Gemma 2, 62 for Gemma 3), unless the file has ``attention.scale``;
- RoPE scaling lives in ``rope.scaling.*`` keys (linear, yarn), in a ``rope_freqs`` tensor
  (Llama 3.1's factors) or in ``rope_factors_long``/``rope_factors_short`` tensors (Phi-3's
  longrope, typeless: Phi-3's converter writes no ``rope.scaling.type``).

GGUF floats are float32: each is written back as the shortest decimal that is the same float32
(``1e-06``, not ``9.99999997e-07``), so the config reads as the original did and computes the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# general.architecture -> Hugging Face model_type (a llama file with a window is Mistral)
MODEL_TYPES = {"gemma3": "gemma3_text"}
# tensors that carry RoPE parameters, not weights
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp's sliding-window patterns: a layer slides unless (i + 1) % pattern == 0
_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6}
# Gemma block counts of the 27B models, which scale queries by hidden/heads (llama.cpp's rule)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA_LOCAL_THETA = 10000.0
_NO_HEAD_DIM = ("qwen2", "phi3")


def hf_config_dict(
    meta: Mapping[str, Any],
    tensor_shapes: Mapping[str, tuple[int, ...]],
    rope_tensors: Mapping[str, list[float]] | None = None,
) -> dict[str, Any]:
    """The Hugging Face config dict of a GGUF file.

    meta: its key/value metadata; tensor_shapes: every tensor's ggml shape (``ne``, innermost
    first); rope_tensors: the contents of the ``ROPE_TENSORS`` the file has.
    Raises ValueError naming the architecture or key it cannot translate.
    """
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED:
        raise ValueError(
            f"GGUF general.architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    k = _Keys(meta, arch)
    hidden, heads = k.need("embedding_length"), k.per_layer("attention.head_count")
    head_dim = k.get("attention.key_length")
    if head_dim is None and arch == "llama":  # llama's converter writes rope dims = head dim
        head_dim = k.get("rope.dimension_count")
    head_dim = head_dim or hidden // heads
    d = {
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": _vocab_size(meta, tensor_shapes),
        "hidden_size": hidden,
        "intermediate_size": k.need("feed_forward_length"),
        "num_hidden_layers": k.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": k.per_layer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(k.need("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": k.get("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "rope_parameters": _rope_parameters(k, head_dim, dict(rope_tensors or {})),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(meta),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "_name_or_path": meta.get("general.name", ""),
    }
    if arch in _NO_HEAD_DIM:  # transformers' Qwen2 and Phi-3 have no head_dim: hidden / heads
        if d.pop("head_dim") != hidden // heads:
            raise ValueError(f"GGUF {arch}.attention.key_length {head_dim} != hidden / heads")
    if arch in ("llama", "qwen3", "gemma2", "gemma3"):
        d["attention_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    if arch == "llama":
        d["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_shapes
        window = k.get("attention.sliding_window")
        if window:  # Mistral v0.1 converted as llama; llama.cpp's converter omits the key
            del d["attention_bias"], d["mlp_bias"]  # Mistral has neither
            d.update(model_type="mistral", sliding_window=window)
    if arch in ("gemma2", "gemma3"):
        d.update(_gemma(k, arch, d))
    if arch == "phi3":
        d["sliding_window"] = k.get("attention.sliding_window") or None  # 0: none (Phi-4)
        if (orig := k.get("rope.scaling.original_context_length")) is not None:
            d["original_max_position_embeddings"] = orig
    return d


class _Keys:
    """``{arch}.``-prefixed metadata lookups that name the missing key."""

    def __init__(self, meta: Mapping[str, Any], arch: str):
        self.meta, self.arch = meta, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        if f"{self.arch}.{key}" not in self.meta:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        return self.meta[f"{self.arch}.{key}"]

    def per_layer(self, key: str, default: Any = None) -> int:
        """A count llama.cpp may store per layer (an array); ours must be one number."""
        value = self.get(key, default) if default is not None else self.need(key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ValueError(f"GGUF {self.arch}.{key} varies by layer ({value}): unsupported")
            value = value[0]
        return int(value)


def _f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32 (GGUF stores float32)."""
    return float(str(np.float32(x)))


def _vocab_size(meta: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> int:
    """The embedding's rows: what the weights need (the converter pads the token list to it,
    Gemma 3's trims the embedding to the token list)."""
    if "token_embd.weight" in shapes:
        return int(shapes["token_embd.weight"][1])  # ggml shape (hidden, vocab)
    raise ValueError("GGUF file has no token_embd.weight tensor")


def _eos_ids(meta: Mapping[str, Any]) -> int | list[int] | None:
    """The end-of-sequence id plus end-of-turn / end-of-message ids when present."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [meta.get(f"tokenizer.ggml.{k}") for k in keys]
    ids = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return ids[0] if len(ids) == 1 else ids or None


def _rope_parameters(k: _Keys, head_dim: int, rope_tensors: dict[str, list[float]]) -> dict:
    """transformers 5.x ``rope_parameters``: one dict, or Gemma 3's per layer type."""
    params = {"rope_type": "default", "rope_theta": _f32(k.get("rope.freq_base", 10000.0))}
    params.update(_rope_scaling(k, rope_tensors))
    rotary = k.get("rope.dimension_count")
    if rotary and rotary != head_dim:  # Phi-3/Phi-4 partial rotary
        params["partial_rotary_factor"] = rotary / head_dim
    if k.arch != "gemma3":
        return params
    local_theta = k.get("rope.freq_base_swa", _GEMMA_LOCAL_THETA)
    local = {"rope_type": "default", "rope_theta": _f32(local_theta)}
    return {"full_attention": params, "sliding_attention": local}


def _rope_scaling(k: _Keys, rope_tensors: dict[str, list[float]]) -> dict:
    kind = k.get("rope.scaling.type")
    if "rope_freqs.weight" in rope_tensors:
        # Llama 3.1's scaling, stored by llama.cpp as per-frequency divisors; flashserve's
        # "freq_factors" RoPE type applies them as they are (no config.json has this type).
        return {"rope_type": "freq_factors", "factors": _f32s(rope_tensors["rope_freqs.weight"])}
    if "rope_factors_long.weight" in rope_tensors:
        return _longrope(k, rope_tensors)
    if kind in (None, "none", ""):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(k.need("rope.scaling.factor"))}
    if kind == "yarn":
        return _yarn(k)
    raise ValueError(
        f"GGUF {k.arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn; "
        "longrope through rope_factors_long/short tensors)"
    )


def _yarn(k: _Keys) -> dict:
    params = {
        "rope_type": "yarn",
        "factor": _f32(k.need("rope.scaling.factor")),
        "original_max_position_embeddings": k.need("rope.scaling.original_context_length"),
    }
    optional = {
        "attention_factor": "yarn_attn_factor",
        "beta_fast": "yarn_beta_fast",
        "beta_slow": "yarn_beta_slow",
    }
    for ours, key in optional.items():
        if (value := k.get(f"rope.scaling.{key}")) is not None:
            params[ours] = _f32(value)
    # What Hugging Face's yarn cannot express: another extrapolation mix, DeepSeek's mscale.
    for key, neutral in (("yarn_ext_factor", 1.0), ("yarn_log_multiplier", 0.0)):
        value = k.get(f"rope.scaling.{key}")
        if value is not None and value != neutral:
            raise ValueError(f"GGUF {k.arch}.rope.scaling.{key} = {value} is not supported")
    return params


def _longrope(k: _Keys, rope_tensors: dict[str, list[float]]) -> dict:
    """Phi-3's longrope: short factors up to the original context, long ones past it."""
    if "rope_factors_short.weight" not in rope_tensors:
        raise ValueError("GGUF file has rope_factors_long.weight but no rope_factors_short.weight")
    orig = k.need("rope.scaling.original_context_length")
    params = {
        "rope_type": "longrope",
        "long_factor": _f32s(rope_tensors["rope_factors_long.weight"]),
        "short_factor": _f32s(rope_tensors["rope_factors_short.weight"]),
        "original_max_position_embeddings": orig,
    }
    # The converter stores Hugging Face's default attention factor; keep it implicit unless the
    # file says otherwise (a float32 copy of the default would differ in the last bits).
    attn = k.get("rope.scaling.attn_factor")
    scale = k.get("context_length", orig) / orig
    default = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
    if attn is not None and not math.isclose(attn, default, rel_tol=1e-6):
        params["attention_factor"] = _f32(attn)
    return params


def _f32s(values: list[float]) -> list[float]:
    return [_f32(v) for v in values]


def _gemma(k: _Keys, arch: str, d: dict) -> dict:
    """Gemma 2/3: GELU-tanh MLP, soft-capping, query scale and which layers slide."""
    layers, window = d["num_hidden_layers"], k.get("attention.sliding_window") or None
    pattern = k.get("attention.sliding_window_pattern", _SWA_PATTERNS[arch])
    if isinstance(pattern, list):  # one flag per layer, True = sliding
        if len(pattern) != layers:
            raise ValueError(f"GGUF {arch}.attention.sliding_window_pattern: {len(pattern)} flags")
        slides = [bool(p) for p in pattern]
    else:
        slides = [(i + 1) % pattern != 0 for i in range(layers)]
    caps = {c: k.get(c) for c in ("attn_logit_softcapping", "final_logit_softcapping")}
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _query_pre_attn_scalar(k, arch, d),
        "sliding_window": window,
        "layer_types": ["sliding_attention" if window and s else "full_attention" for s in slides],
        **{c: None if v is None else _f32(v) for c, v in caps.items()},
    }


def _query_pre_attn_scalar(k: _Keys, arch: str, d: dict) -> float:
    """Queries are scaled by ``query_pre_attn_scalar ** -0.5``."""
    scale = k.get("attention.scale")
    if scale:
        value = 1.0 / float(scale) ** 2
        return round(value) if abs(value - round(value)) < 1e-3 else value
    if d["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]:
        return d["hidden_size"] // d["num_attention_heads"]
    return d["head_dim"]
