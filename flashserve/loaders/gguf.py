"""GGUF files (llama.cpp): metadata to ``ModelConfig``, tensors dequantized to float32 and
renamed to Hugging Face names, Q/K rows put back in Hugging Face's order."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import gguf
import numpy as np
import torch

from flashserve.models.config import ModelConfig

ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's Llama 3.1 RoPE factors; goes into the config
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key/value of the file as ``{key: python value}``."""
    return {key: field.contents() for key, field in reader.fields.items()}


def read_config(reader: gguf.GGUFReader, meta: dict[str, Any], name: str) -> ModelConfig:
    names = {t.name for t in reader.tensors}
    freqs = None
    if ROPE_FREQS in names:
        tensor = next(t for t in reader.tensors if t.name == ROPE_FREQS)
        freqs = _dequantize(tensor).reshape(-1).tolist()
    return ModelConfig.from_gguf_metadata(meta, names, rope_freqs=freqs, name=name)


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; names we do not
    know pass through unchanged (``load_weights`` then reports them as unexpected)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def iter_weights(
    reader: gguf.GGUFReader, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor dequantized to float32 (one at a time), with its Hugging Face name."""
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        weight = torch.from_numpy(_dequantize(tensor))  # [rows, cols] or [n]
        yield hf_name(tensor.name), _to_hf_layout(tensor.name, weight, config)


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """float32, numpy's (row-major) shape, i.e. ggml's dimensions reversed."""
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    data = data.reshape(tuple(int(n) for n in reversed(tensor.shape)))
    return data if data.flags.writeable else data.copy()


def _to_hf_layout(name: str, w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp interleaves the two RoPE halves of each Llama Q/K head; undo that."""
    if config.architecture != "llama":
        return w
    if ".attn_q." in name:
        return unpermute_qk(w, config.num_attention_heads)
    if ".attn_k." in name:
        return unpermute_qk(w, config.num_key_value_heads)
    return w


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:  # [H*D, ...] -> same
    """Inverse of llama.cpp's ``permute``: within each head, GGUF row ``2*j + i`` holds
    Hugging Face row ``i*D/2 + j`` (``i`` the RoPE half, ``j < D/2``)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
