"""Models. Every supported architecture runs one decoder (``flashserve.models.decoder``);
``get_model_class`` maps a ``ModelConfig.architecture`` to it."""

from __future__ import annotations

from flashserve.models.config import SUPPORTED_ARCHITECTURES
from flashserve.models.decoder import DecoderForCausalLM


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The ``nn.Module`` class for an architecture name (``ModelConfig.architecture``)."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    return DecoderForCausalLM


__all__ = ["DecoderForCausalLM", "get_model_class"]
