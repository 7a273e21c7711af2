"""The Llama-family model against Hugging Face transformers, on tiny random models (CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from model_utils import (
    LINEAR_ROPE,
    LLAMA3_ROPE,
    TINY,
    VARIANTS,
    assert_close,
    block_tables,
    describe_diff,
    hf_logits,
    make_hf,
    make_kv_caches,
    random_prompts,
    rel_err,
    run_chunks,
    run_prompts,
)
from transformers.models.llama import modeling_llama as hf_llama

from flashserve.models import get_model_class
from flashserve.models.attention import TorchBackend, load_backend
from flashserve.models.config import ModelConfig
from flashserve.models.decoder import DecoderForCausalLM, RMSNorm, build_model, init_random
from flashserve.models.rope import RotaryEmbedding
from kernels import reference as torch_ops
from kernels.reference import rope_write_kv

PROMPT_LENS = [1, 17, 40, 5]  # the one-token prompt runs as a decode token
TORCH = load_backend("torch")


def ours_from_hf(hf, dtype: torch.dtype = torch.float32) -> DecoderForCausalLM:
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    model = build_model(config, TORCH, "cpu", dtype)
    model.load_weights(hf.state_dict().items())
    return model


@pytest.mark.parametrize("shuffle", [False, True], ids=["contiguous", "shuffled"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers_fp32(variant, shuffle):
    hf = make_hf(variant)
    model = ours_from_hf(hf)
    prompts = random_prompts(PROMPT_LENS, TINY["vocab_size"])
    ours = run_prompts(model, prompts, block_size=8, shuffle=shuffle)
    assert_close(ours, hf_logits(hf, prompts), 1e-4)


def test_logits_match_transformers_bf16():
    """bf16 weights and activations on both sides; both round differently, hence 2e-2."""
    hf = make_hf("llama-tied-llama3rope", torch.bfloat16)
    model = ours_from_hf(hf, torch.bfloat16)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    prompts = random_prompts([9, 33], TINY["vocab_size"])
    assert_close(run_prompts(model, prompts), hf_logits(hf, prompts), 2e-2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_norms_left_to_the_projections_match_transformers(variant, dtype, tol):
    """A backend that fuses the norms between projections (``fuses_norms``: o_proj and down
    add to the stream and leave its sums of squares, qkv and gate/up norm as they read): no
    add_rms_norm runs, and the logits are transformers' and the unfused model's."""
    hf = make_hf(variant, dtype)
    config = ModelConfig.from_hf_dict(hf.config.to_dict())
    backend = TorchBackend(fuse_norms=True)
    calls = []
    backend.add_rms_norm = lambda *a, **k: calls.append(a) or torch_ops.add_rms_norm(*a, **k)
    model = build_model(config, backend, "cpu", dtype)
    model.load_weights(hf.state_dict().items())
    prompts = random_prompts([1, 9, 33], TINY["vocab_size"])
    ours = run_prompts(model, prompts)
    assert not calls, "a norm between projections ran on its own"
    assert_close(ours, hf_logits(hf, prompts), tol)
    assert_close(ours, run_prompts(ours_from_hf(hf, dtype), prompts), tol / 10)


def test_config_from_transformers_configs():
    llama3 = ModelConfig.from_hf_dict(make_hf("llama-tied-llama3rope").config.to_dict())
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.tie_word_embeddings
    assert (llama3.head_dim, llama3.num_key_value_heads, llama3.eos_token_ids) == (16, 2, [2])
    bias = ModelConfig.from_hf_dict(make_hf("llama-bias-linearrope").config.to_dict())
    assert bias.attention_bias and bias.attention_out_bias and bias.rope_scaling["factor"] == 4
    qwen = ModelConfig.from_hf_dict(make_hf("qwen2-tied").config.to_dict())
    assert qwen.attention_bias and not qwen.attention_out_bias  # Qwen2: q/k/v bias only
    mistral = ModelConfig.from_hf_dict(make_hf("mistral-headdim32").config.to_dict())
    assert (mistral.head_dim, mistral.architecture) == (32, "mistral")


def test_config_from_old_style_dict():
    """transformers 4.x layout: rope_theta at top level, rope_scaling with ``type``."""
    d = {
        "architectures": ["LlamaForCausalLM"],
        **TINY,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [7, 9],
    }
    c = ModelConfig.from_hf_dict(d)
    assert (c.architecture, c.rope_theta, c.eos_token_ids) == ("llama", 500000.0, [7, 9])
    assert c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert (
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "default"}}).rope_scaling
        is None
    )
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_hf_dict({**d, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_scaling type 'mrope'"):
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"type": "mrope", "factor": 2.0}})


def test_qwen2_without_attention_bias_key_has_qkv_bias():
    d = {"model_type": "qwen2", **TINY}
    assert "attention_bias" not in d
    assert ModelConfig.from_hf_dict(d).attention_bias


def test_decode_and_chunked_prefill_match_full_prompt():
    """Prefill a prefix, then mixed steps (decode tokens first, then a prefill chunk), through
    one shuffled paged cache: every token's logits equal those of one whole-prompt pass."""
    hf = make_hf("llama-tied-llama3rope")
    model = ours_from_hf(hf)
    prompts = random_prompts([30, 21, 26], TINY["vocab_size"])
    full = run_prompts(model, prompts, block_size=4)
    bs = 4
    table, num_blocks = block_tables([len(p) for p in prompts], bs, shuffle=True)
    caches = make_kv_caches(model, num_blocks, bs)
    got = [[] for _ in prompts]
    # step 1: prefill 20 / 20 / 10 tokens
    for i, out in enumerate(
        run_chunks(model, caches, table, _chunks(prompts, [0] * 3, [20, 20, 10]), bs)
    ):
        got[i].append(out)
    # steps 2+: sequences 0, 1 decode one token at a time; sequence 2 prefills 2-token chunks
    for step in range(8):
        starts = [20 + step, 20 + step, 10 + 2 * step]
        chunks = _chunks(prompts, starts, [1, 1 if step == 0 else 0, 2])
        live = [i for i, (ids, _) in enumerate(chunks) if ids]
        outs = run_chunks(model, caches, table[live], [chunks[i] for i in live], bs)
        for i, out in zip(live, outs, strict=True):
            got[i].append(out)
    for i in range(len(prompts)):
        ours = torch.cat(got[i])
        ref = full[i][: len(ours)]
        assert rel_err(ours, ref) < 1e-5, f"sequence {i}: {describe_diff(ours, ref)}"


def _chunks(prompts, starts, counts):
    return [(p[s : s + n], s) for p, s, n in zip(prompts, starts, counts, strict=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_transformers(dtype):
    x = (torch.randn(7, 64) * 3).to(dtype)
    ours, ref = RMSNorm(64, 1e-5), hf_llama.LlamaRMSNorm(64, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(64))
        ref.weight.copy_(ours.weight)
    ours, ref = ours.to(dtype), ref.to(dtype)
    assert torch.equal(ours(x), ref(x)), describe_diff(ours(x), ref(x))


@pytest.mark.parametrize(
    "rope", [None, LLAMA3_ROPE, LINEAR_ROPE], ids=["plain", "llama3", "linear"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_transformers(rope, dtype):
    extra = {"rope_parameters": rope} if rope else {}
    hf_config = transformers.LlamaConfig(**TINY, **extra)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    pos = torch.randint(0, TINY["max_position_embeddings"], (11,))
    q = torch.randn(11, 4, 16).to(dtype)
    k = torch.randn(11, 2, 16).to(dtype)
    cos_hf, sin_hf = hf_llama.LlamaRotaryEmbedding(hf_config)(q, pos[None])  # [1, T, D]
    q_hf, k_hf = hf_llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf
    )  # [1, H, T, D]
    # ours: RoPE fused with the KV store, on a fused qkv row, keys read back from the cache
    table = RotaryEmbedding(config).to(dtype)
    v = torch.randn(11, 2, 16).to(dtype)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    k_cache, v_cache = torch.zeros(2, 3, 4, 2, 16, dtype=dtype)
    slots = torch.randperm(12)[:11]
    q_ours = rope_write_kv(qkv, pos, table.cos, table.sin, k_cache, v_cache, slots, 4, 2)
    k_ours = k_cache.view(-1, 2, 16)[slots]
    for ours, ref in ((q_ours, q_hf), (k_ours, k_hf)):
        ref = ref[0].transpose(0, 1)
        assert torch.equal(ours, ref), describe_diff(ours, ref)
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v)


def test_load_weights_names_missing_unexpected_and_misshapen():
    hf = make_hf("llama")
    model = build_model(ModelConfig.from_hf_dict(hf.config.to_dict()), TORCH, "cpu", torch.float32)
    state = dict(hf.state_dict())
    del state["model.layers.1.self_attn.k_proj.weight"]
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError) as err:
        model.load_weights(state.items())
    msg = str(err.value)
    assert "missing: model.layers.1.self_attn.k_proj.weight" in msg
    assert "unexpected: model.layers.0.mlp.extra.weight" in msg
    state = dict(hf.state_dict())
    state["model.norm.weight"] = torch.ones(63)
    with pytest.raises(ValueError, match=r"model.norm.weight: checkpoint shape \(63,\)"):
        model.load_weights(state.items())


def test_load_weights_fills_fused_slices():
    hf = make_hf("llama-bias-linearrope")
    model = ours_from_hf(hf)
    attn, ref = model.model.layers[1].self_attn, hf.model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight[64:128], ref.k_proj.weight)
    assert torch.equal(attn.qkv_proj.bias[128:], ref.v_proj.bias)
    assert torch.equal(
        model.model.layers[0].mlp.gate_up_proj.weight[128:], hf.model.layers[0].mlp.up_proj.weight
    )


def test_build_model_meta_then_device_and_random_init():
    config = ModelConfig.from_hf_dict(transformers.LlamaConfig(**TINY).to_dict())
    model = build_model(config, TORCH, "cpu", torch.bfloat16)
    init_random(model, seed=3)
    again = build_model(config, TORCH, "cpu", torch.bfloat16)
    init_random(again, seed=3)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and p.device.type == "cpu", name
        assert torch.equal(p, q), f"{name} differs between two builds with one seed"
    w = model.model.layers[0].self_attn.qkv_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and torch.all(model.model.norm.weight == 1)
    ref = RotaryEmbedding(config)
    assert torch.equal(model.model.rotary_emb.cos, ref.cos.to(torch.bfloat16))


def test_ensure_positions_extends_rope_cache():
    config = ModelConfig.from_hf_dict(transformers.LlamaConfig(**TINY).to_dict())
    model = DecoderForCausalLM(config, TORCH)
    model.ensure_positions(300)
    big = RotaryEmbedding(ModelConfig(**{**config.__dict__, "max_position_embeddings": 300}))
    assert torch.equal(model.model.rotary_emb.sin, big.sin)


def test_get_model_class():
    assert get_model_class("qwen2") is DecoderForCausalLM
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        get_model_class("gpt2")
