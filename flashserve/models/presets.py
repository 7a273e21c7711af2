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

_LLAMA31_ROPE = {
    "max_position_embeddings": 131072,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}

PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": _LLAMA3_8B,
    # Llama 3.1: same shapes, 128K context through llama3 RoPE scaling
    "llama3.1-8b": {**_LLAMA3_8B, **_LLAMA31_ROPE},
    # meta-llama/Llama-3.1-70B: 141 GB of bf16 weights, for tensor parallelism (2+ GPUs)
    "llama3.1-70b": {
        **_LLAMA3_8B,
        **_LLAMA31_ROPE,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
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
    # Qwen/Qwen3-8B: q/k head norms, head_dim 128 (not hidden / heads), no window in use
    "qwen3-8b": {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    # google/gemma-3-12b-it's text model (its text_config, as the hub writes it): 5 local
    # layers (window 1,024, theta 10,000) to 1 global (theta 1,000,000, linear RoPE x8)
    "gemma3-12b": {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
    },
    # microsoft/phi-4 (14B): Phi-3's architecture, full rotary, no window
    "phi4": {
        "model_type": "phi3",
        "vocab_size": 100352,
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "rope_scaling": None,
        "max_position_embeddings": 16384,
        "original_max_position_embeddings": 16384,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100257,
    },
    # mistralai/Mistral-7B-v0.1: every layer a 4,096-token sliding window
    "mistral-7b-v0.1": {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
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
    attn += 2 * c.head_dim * c.qk_norm
    norms = (4 if c.sandwich_norms else 2) * h
    layer = attn + 3 * h * c.intermediate_size + norms
    head = 0 if c.tie_word_embeddings else c.vocab_size * h
    return c.num_hidden_layers * layer + c.vocab_size * h + h + head
