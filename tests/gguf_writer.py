"""Test-only: GGUF files of tiny transformers models, written as llama.cpp's
``convert_hf_to_gguf.py`` writes them (its metadata keys per architecture, gguf-py's own
Hugging Face -> GGUF tensor names, the Q/K row interleave for ``llama``, ``1 + w`` Gemma norms,
RoPE factors as tensors), and a byte-level tokenizer to go with them.

Written from the converter's classes (LlamaModel, Qwen2Model/Qwen3Model, Gemma2Model,
Gemma3Model, Phi3MiniModel and TextModel.set_gguf_parameters), so the loader is checked against
an independent account of the format, not against its own inverse.
"""

from __future__ import annotations

import math

import gguf
import numpy as np

from flashserve.tokenizer.gguf import byte_alphabet

Q = gguf.GGMLQuantizationType
# transformers model_type -> GGUF architecture (llama.cpp converts Mistral as llama)
GGUF_ARCHS = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
BOS, EOS = 256, 257  # add_tokenizer's special ids


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert script: interleave each head's two RoPE halves."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_tokenizer(w: gguf.GGUFWriter, vocab_size: int) -> None:
    """Byte-level BPE (no merges): 256 byte tokens, <s> = 256, </s> = 257, then fillers."""
    tokens = [*byte_alphabet().values(), "<s>", "</s>"]
    tokens += [f"<x{i}>" for i in range(vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3] + [4] * (vocab_size - 258))
    w.add_token_merges([])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)


def converter_tensors(hf) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of each tensor the converter writes for ``hf``."""
    c = hf.config
    arch = GGUF_ARCHS[c.model_type]
    names = gguf.get_tensor_name_map(_model_arch(arch), c.num_hidden_layers)
    out = []
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and (c.tie_word_embeddings or arch == "gemma2"):
            continue  # llama.cpp: no output.weight means tied
        arr = t.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = llamacpp_permute(arr, c.num_attention_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = llamacpp_permute(arr, c.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # Gemma's (1 + w) folded into the weight
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf-py has no GGUF name for {name}"
        out.append((gguf_name, arr))
    return out + _extra_tensors(arch, c)


def write_gguf(path, hf, qtype=Q.F32, name: str = "tiny") -> None:
    """A GGUF file of ``hf`` (a transformers model), 2-D weights stored as ``qtype``."""
    c = hf.config
    arch = GGUF_ARCHS[c.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    _METADATA[arch](w, c)
    add_tokenizer(w, c.vocab_size)
    for gguf_name, arr in converter_tensors(hf):
        if arr.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantized(arr: np.ndarray, qtype) -> np.ndarray:
    """What a 2-D ``arr`` becomes once stored as ``qtype`` and read back."""
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)


def _extra_tensors(arch: str, c) -> list[tuple[str, np.ndarray]]:
    """Phi3MiniModel.generate_extra_tensors: longrope's factors."""
    rope = c.rope_parameters
    if arch != "phi3" or rope.get("rope_type") != "longrope":
        return []
    return [
        ("rope_factors_long.weight", np.array(rope["long_factor"], np.float32)),
        ("rope_factors_short.weight", np.array(rope["short_factor"], np.float32)),
    ]


def _text_model(w: gguf.GGUFWriter, c) -> None:
    """TextModel.set_gguf_parameters (llama, qwen2, qwen3, gemma3)."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    params = c.rope_parameters.get("full_attention", c.rope_parameters)
    kind = params.get("rope_type")
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(params["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if (attn := params.get("attention_factor")) is not None:
            w.add_rope_scaling_yarn_attn_factor(attn)
        if (fast := params.get("beta_fast")) is not None:
            w.add_rope_scaling_yarn_beta_fast(fast)
        if (slow := params.get("beta_slow")) is not None:
            w.add_rope_scaling_yarn_beta_slow(slow)
    w.add_rope_freq_base(params["rope_theta"])
    if "sliding_attention" in c.rope_parameters:
        w.add_rope_freq_base_swa(c.rope_parameters["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if "head_dim" in c.to_dict():
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)


def _llama(w: gguf.GGUFWriter, c) -> None:
    """LlamaModel (Llama and Mistral), plus Mistral's window, which llama.cpp's converter drops
    (its files of Mistral v0.1 attend to the whole context) but the loader honours when present."""
    _text_model(w, c)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)


def _gemma2(w: gguf.GGUFWriter, c) -> None:
    """Gemma2Model: its own keys, not TextModel's (no RoPE base: llama.cpp's 10,000)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _gemma3(w: gguf.GGUFWriter, c) -> None:
    _text_model(w, c)
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    w.add_sliding_window(c.sliding_window)


def _phi3(w: gguf.GGUFWriter, c) -> None:
    """Phi3MiniModel: its own keys; the RoPE dims carry the partial rotary factor."""
    rope = c.rope_parameters
    rotary = int(rope.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads
    w.add_context_length(c.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(rotary)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.sliding_window or 0)
    if rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        orig = c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        )


_METADATA = {
    "llama": _llama,
    "qwen2": _text_model,
    "qwen3": _text_model,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
}
