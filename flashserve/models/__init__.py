"""Model families. ``get_model_class`` maps a ``ModelConfig.architecture`` to its module."""

from __future__ import annotations

from flashserve.models.llama import LlamaForCausalLM

# Llama, Mistral and Qwen2 share one decoder; they differ only in config values.
_MODELS = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}


def get_model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The ``nn.Module`` class for an architecture name (``ModelConfig.architecture``)."""
    if architecture not in _MODELS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    return _MODELS[architecture]


__all__ = ["LlamaForCausalLM", "get_model_class"]
