"""GGUF files (llama.cpp): the config and the weights of the Hugging Face checkpoint they were
converted from.

The metadata becomes a Hugging Face config dict (``gguf_config``) and then a ``ModelConfig``
through ``ModelConfig.from_hf_dict``, the one way in for every architecture. Each tensor is
dequantized to float32 on the device it goes to (``gguf_quants``), renamed to its Hugging Face
name and put back in Hugging Face's layout, undoing what llama.cpp's converter did to it:
- ``llama``: the rows of each Q/K head interleaved (``permute``), weights and biases;
- ``gemma2``/``gemma3``: ``1`` added to every RMSNorm weight (llama.cpp's norm has no ``1 + w``).
  Subtracting it back is exact when the stored value is at least 0.5 (Sterbenz), so the model's
  ``1 + w`` is then the file's float32 value bit for bit;
- Phi-3's fused ``attn_qkv`` and ``ffn_up`` (gate then up) are Hugging Face's own ``qkv_proj``
  and ``gate_up_proj``: renamed only.
"""

from __future__ import annotations

import math
import mmap
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from flashserve.loaders import gguf_quants
from flashserve.loaders.gguf_config import ROPE_TENSORS, hf_config_dict
from flashserve.loaders.gguf_header import Header, TensorInfo, read_header
from flashserve.models.config import ModelConfig

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
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma norms around both sublayers: llama.cpp's ffn_norm is Gemma's pre-feedforward norm
_GEMMA_NAMES = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "gemma2": {**_LAYER_NAMES, **_GEMMA_NAMES},
    "gemma3": {**_LAYER_NAMES, **_GEMMA_NAMES},
    "phi3": {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"},  # gate and up, fused
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_UNIT_OFFSET_NORMS = ("gemma2", "gemma3")  # archs whose files store 1 + w for each norm
_QK_NAMES = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")  # llama permutes


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file whose header ``gguf_header.read_header`` has read and checked (every
    tensor's bytes within the file, of a type we can dequantize), its data memory-mapped.

    ``gguf.GGUFReader`` is not used: it builds a numpy view of every metadata item (6 s for
    the default model's 49K tokens and merges), where the header we read anyway has them."""

    header: Header
    data: mmap.mmap

    @property
    def metadata(self) -> dict[str, Any]:
        return self.header.metadata

    @property
    def tensors(self) -> list[TensorInfo]:
        return self.header.tensors

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def raw(self, tensor: TensorInfo) -> np.ndarray:
        """``tensor``'s bytes, uint8 ``[rows, bytes a row]`` (a row: ggml's innermost
        dimension), read-only, as ``gguf.quants.dequantize`` takes them."""
        rows = math.prod(tensor.shape[1:])
        at = self.header.data_offset + tensor.offset
        return np.frombuffer(self.data, np.uint8, tensor.nbytes, at).reshape(rows, -1)


def open_file(path: Path) -> GGUFFile:
    """``path`` with its header read and checked (WeightsError naming the file otherwise)."""
    header = read_header(path)
    with path.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # stays valid once f closes
    return GGUFFile(header, data)


def read_hf_config(file: GGUFFile) -> dict[str, Any]:
    """The Hugging Face config dict (transformers 5.x layout) the file was converted from."""
    shapes = {t.name: t.shape for t in file.tensors}
    rope = {t.name: _dequantize(file, t).reshape(-1).tolist()
            for t in file.tensors if t.name in ROPE_TENSORS}  # fmt: skip
    return hf_config_dict(file.metadata, shapes, rope)


def read_config(file: GGUFFile, name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_hf_config(file), name=name)


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; names we do not
    know pass through unchanged (``load_weights`` then reports them as unexpected)."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    m = _LAYER_RE.fullmatch(gguf_name)
    names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    return gguf_name


def iter_weights(
    file: GGUFFile, config: ModelConfig, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor dequantized to float32 on ``device`` (one at a time), with its Hugging Face
    name, in Hugging Face's layout. ``config`` gives the head counts that un-permute Q/K (a
    transformers config built from ``read_hf_config`` serves too)."""
    arch = file.architecture
    for tensor in file.tensors:
        if tensor.name in ROPE_TENSORS:
            continue  # read into the config
        weight = _dequantize(file, tensor, device)  # [rows, cols] or [n]
        name = hf_name(tensor.name, arch)
        yield name, _to_hf_layout(arch, name, weight, config)


def _dequantize(
    file: GGUFFile, tensor: TensorInfo, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """float32 on ``device``, in numpy's (row-major) shape, i.e. ggml's dimensions reversed; a
    new tensor, never a view of the read-only map. The packed bytes go to ``device`` and torch
    unpacks them there (``gguf_quants``); types it does not take go through the ``gguf``
    package on the CPU."""
    raw = file.raw(tensor)
    if tensor.type in gguf_quants.TYPES:
        with warnings.catch_warnings():  # read-only: dequantize writes a new tensor
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            packed = torch.from_numpy(raw)
        data = gguf_quants.dequantize(packed.to(device), tensor.type)
    else:
        data = torch.from_numpy(np.array(gguf.quants.dequantize(raw, tensor.type))).to(device)
    return data.reshape(tuple(reversed(tensor.shape)))


def _to_hf_layout(arch: str, name: str, w: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if arch == "llama" and name.endswith(_QK_NAMES):
        heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        # rows of the wrong count would not split into heads: the tensor goes on as it is,
        # and the model names its shape and the one it expects
        return unpermute_qk(w, heads) if w.shape[0] == heads * config.head_dim else w
    if arch in _UNIT_OFFSET_NORMS and name.endswith("norm.weight"):
        return w - 1.0
    return w


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:  # [H*D, ...] -> same
    """Inverse of llama.cpp's ``permute``: within each head, GGUF row ``2*j + i`` holds
    Hugging Face row ``i*D/2 + j`` (``i`` the RoPE half, ``j < D/2``)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
