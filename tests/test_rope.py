"""Our RoPE tables against transformers' rotary embeddings, per scaling, position by position;
and the two length-dependent rules (dynamic, longrope) as ``flashserve.models.rope`` states
them."""

from __future__ import annotations

import pytest
import torch
import transformers
from model_utils import describe_diff
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from flashserve.models.config import ModelConfig
from flashserve.models.rope import RotaryEmbedding

SHAPE = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
ORIGINAL = 128
FACTORS = [1.0 + 0.4 * i for i in range(16)]  # longrope: 16 per head of 64 at factor 0.5
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale-beta": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 8, "beta_slow": 2,
                         "mscale": 0.9, "mscale_all_dim": 0.7, "truncate": False,
                         "original_max_position_embeddings": ORIGINAL},
}  # fmt: skip


def _ours(hf_config, context_len: int | None = None) -> RotaryEmbedding:
    rotary = RotaryEmbedding(ModelConfig.from_hf_dict(hf_config.to_dict()))
    if context_len:
        rotary.resize(context_len)
    return rotary


def _hf_cos_sin(rotary, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = rotary(x, positions[None])  # [1, P, R]
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Within float32 rounding: the tables are cos/sin values (times an attention factor)."""
    assert ours.shape == ref.shape, what
    assert (ours - ref).abs().max() < 2e-6, f"{what}: {describe_diff(ours, ref)}"


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_static_scalings_match_transformers(name):
    theta = {"rope_theta": 50000.0}
    config = transformers.LlamaConfig(**SHAPE, rope_parameters={**SCALINGS[name], **theta})
    ours, hf = _ours(config), LlamaRotaryEmbedding(config)
    cos, sin = _hf_cos_sin(hf, torch.arange(SHAPE["max_position_embeddings"]))
    _assert_close(ours.cos, cos, "cos")
    _assert_close(ours.sin, sin, "sin")


@pytest.mark.parametrize("context_len", [ORIGINAL, ORIGINAL + 1], ids=["short", "long"])
def test_longrope_factors_follow_the_served_length(context_len):
    """Long factors at every position once the engine serves past the original length (what
    transformers uses for a sequence that long), short ones up to it; the attention factor
    from max_position_embeddings / original_max_position_embeddings either way; partial
    rotary (half the head)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": FACTORS, "long_factor": [f * 3 for f in FACTORS]}  # fmt: skip
    config = transformers.Phi3Config(**SHAPE, original_max_position_embeddings=ORIGINAL,
                                     pad_token_id=0, rope_parameters=rope)  # fmt: skip
    ours = _ours(config, context_len)
    assert ours.cos.shape == (SHAPE["max_position_embeddings"], 16)
    cos, sin = _hf_cos_sin(Phi3RotaryEmbedding(config), torch.arange(context_len))
    _assert_close(ours.cos[:context_len], cos, "cos")
    _assert_close(ours.sin[:context_len], sin, "sin")
    assert Phi3RotaryEmbedding(config).attention_scaling == pytest.approx(
        (1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(128.0)).item()) ** 0.5
    )


def test_dynamic_turns_each_position_with_the_base_of_its_length():
    """Position p gets transformers' NTK base for a sequence of p + 1 tokens: the row of p
    when transformers runs the positions 0..p (as it does decoding the token at p)."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = transformers.LlamaConfig(**{**SHAPE, "max_position_embeddings": 64},
                                      rope_parameters=rope)  # fmt: skip
    ours = _ours(config, 300)
    for p in (0, 63, 64, 65, 100, 299):
        cos, sin = _hf_cos_sin(LlamaRotaryEmbedding(config), torch.arange(p + 1))
        _assert_close(ours.cos[p], cos[-1], f"cos at {p}")
        _assert_close(ours.sin[p], sin[-1], f"sin at {p}")
    # past the original length, the base grows with the position: not one table for all
    plain = _ours(transformers.LlamaConfig(**SHAPE, rope_parameters={"rope_theta": 10000.0}))
    assert torch.equal(ours.cos[:64], plain.cos[:64])
    assert not torch.allclose(ours.cos[100], plain.cos[100])


def test_gemma3_local_and_global_tables():
    """Gemma 3: the sliding layers' table from the local theta, the global layers' from the
    global theta with its own scaling; each layer reads its own."""
    config = transformers.Gemma3TextConfig(
        **{**SHAPE, "num_hidden_layers": 3}, head_dim=64, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )  # fmt: skip
    ours = ModelConfig.from_hf_dict(config.to_dict())
    assert ours.layer_rope == (1, 0, 1)
    hf = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(config)
    positions = torch.arange(SHAPE["max_position_embeddings"])[None]
    for local, layer_type in ((False, "full_attention"), (True, "sliding_attention")):
        cos, _ = hf(torch.zeros(1), positions, layer_type)
        _assert_close(RotaryEmbedding(ours, local=local).cos, cos[0, :, :32], layer_type)
