"""Shapes of real models, as Hugging Face ``config.json`` dicts, for ``dummy:<preset>`` models
(random weights at full size, for benchmarks) and ``tiny`` for tests."""

from __future__ import annotations

from typing import Any

from flashserve.models.config import ModelConfig

_LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    # Llama 3.1: same shapes, 128K context through llama3 RoPE scaling
    "llama3.1-8b": {
        **_LLAMA3_8B,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    },
    "llama2-7b": {
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    # for tests: big enough for a byte-level tokenizer (256 bytes + BOS + EOS)
    "tiny": {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


def preset_config(name: str) -> ModelConfig:
    """The ``ModelConfig`` of a preset; ValueError listing the presets for an unknown name."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig.from_hf_dict(PRESETS[name], name=f"dummy:{name}")


def num_parameters(config: ModelConfig) -> int:
    """Parameter count from the shapes alone (no tensors)."""
    h, c = config.hidden_size, config
    attn = h * (c.q_size + 2 * c.kv_size) + c.q_size * h
    attn += (c.q_size + 2 * c.kv_size) * c.attention_bias + h * c.attention_out_bias
    layer = attn + 3 * h * c.intermediate_size + 2 * h
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * layer + c.vocab_size * h + h + head
