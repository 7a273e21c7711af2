"""Every architecture and RoPE scaling against transformers, end to end on CPU in fp32.

Each case is a tiny random checkpoint written by transformers' own classes, saved in the
5.x config.json layout and rewritten into the 4.x one (``rope_theta`` + ``rope_scaling``,
``rope_local_base_freq``, ``sliding_window_pattern``), then loaded through our normal path
(``load_model``, and the engine ``LLM``). On both layouts transformers reads the same
directory. Checked: the prompt's logits (last token within 1e-4, and every token), the
logits of 16 decode steps over transformers' own greedy tokens, and the engine's 16 greedy
tokens through chunked prefill whose chunks cross the window edges. Windowed models get
prompts longer than 3x their window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import transformers
from model_utils import (
    assert_greedy_matches,
    block_tables,
    describe_diff,
    make_kv_caches,
    randomize,
    rel_err,
    run_chunks,
)
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.loaders.load import load_model
from flashserve.models.config import ModelConfig
from flashserve.sampling.params import SamplingParams

VOCAB = 512
WINDOW = 8
NEW_TOKENS = 16
BLOCK = 4  # KV block size of the model-level checks (the engine uses its own, 16)
CHUNK = 10  # the engine's token budget: prefill chunks of 10 cross the 8-token window edges
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
SW = "sliding_attention"
FULL = "full_attention"


@dataclass
class Case:
    cls: type  # the transformers config class
    kwargs: dict[str, Any]
    prompt_len: int = 4 * WINDOW + 3
    max_model_len: int | None = None  # the engine's (longrope picks its factors from it)
    windows: tuple[int, ...] = ()  # the layer windows we must read from the config
    extra: dict[str, Any] = field(default_factory=dict)  # more ModelConfig fields to check


PHI3_IDS = dict(pad_token_id=0, eos_token_id=2)
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.2, 1.7, 2.6],
    "long_factor": [1.0, 2.1, 5.3, 12.0],
}
CASES = {
    "qwen3-window-layer1": Case(
        transformers.Qwen3Config,
        dict(
            head_dim=32,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
        windows=(0, WINDOW),
        extra={"qk_norm": True},
    ),
    "qwen3-bias-nowindow": Case(
        transformers.Qwen3Config,
        dict(attention_bias=True, sliding_window=WINDOW, max_window_layers=0),
        windows=(0, 0),
        extra={"attention_out_bias": True},
    ),
    "qwen2-window-layer1": Case(
        transformers.Qwen2Config,
        dict(
            num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        windows=(0, WINDOW, WINDOW),
    ),
    "mistral-window": Case(
        transformers.MistralConfig, dict(sliding_window=WINDOW), windows=(WINDOW, WINDOW)
    ),
    "gemma2": Case(
        transformers.Gemma2Config,
        dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24),
        windows=(WINDOW, 0),
        extra={"attn_logit_softcap": 50.0, "final_logit_softcap": 30.0},
    ),
    "gemma3-local-global-linear8": Case(
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=3,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=[SW, SW, FULL],
            rope_parameters={
                FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                SW: {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        windows=(WINDOW, WINDOW, 0),
        extra={"local_rope_theta": 1e4},
    ),
    "phi3-longrope-short-partial": Case(
        transformers.Phi3Config,
        dict(
            **PHI3_IDS,
            partial_rotary_factor=0.5,
            sliding_window=WINDOW,
            original_max_position_embeddings=64,
            rope_parameters={**LONGROPE, "partial_rotary_factor": 0.5},
        ),
        prompt_len=40,
        max_model_len=64,
        windows=(WINDOW, WINDOW),
    ),
    "phi3-longrope-long-partial": Case(
        transformers.Phi3Config,
        dict(
            **PHI3_IDS,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=64,
            rope_parameters={**LONGROPE, "partial_rotary_factor": 0.5},
        ),
        prompt_len=80,
        max_model_len=256,
    ),
    "llama-llama3-tied": Case(
        transformers.LlamaConfig,
        dict(
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        prompt_len=70,
    ),
    "llama-linear-bias": Case(
        transformers.LlamaConfig,
        dict(attention_bias=True, rope_parameters={"rope_type": "linear", "factor": 4.0}),
        extra={"attention_out_bias": True},
    ),
    "llama-yarn": Case(
        transformers.LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        prompt_len=90,
    ),
    "qwen2-yarn-mscale": Case(
        transformers.Qwen2Config,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "beta_fast": 16,
                "beta_slow": 2,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "original_max_position_embeddings": 32,
            }
        ),
        prompt_len=60,
    ),
    # within max_position_embeddings (48) for the prompt; decoding runs past it
    "llama-dynamic": Case(
        transformers.LlamaConfig,
        dict(
            max_position_embeddings=48,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        prompt_len=40,
        max_model_len=64,
    ),
}


@pytest.mark.parametrize("layout", ["5.x", "4.x"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_architecture_matches_transformers(tmp_path, name, layout):
    case = CASES[name]
    hf = transformers.AutoModelForCausalLM.from_config(case.cls(**{**SHAPE, **case.kwargs}))
    save_checkpoint(hf, tmp_path, layout)
    config = check_against_transformers(tmp_path, case.prompt_len, case.max_model_len)
    if case.windows:
        assert config.layer_windows == case.windows
    for key, value in case.extra.items():
        assert getattr(config, key) == value, key


def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path):
    """A Gemma 3 image-text checkpoint whose text_config gives only a few keys, as the hub's
    do (Gemma 3 4B/12B/27B): the rest are Gemma3TextConfig's defaults (5 local : 1 global
    layers, local theta 10,000, global 1,000,000 with the 4.x rope_scaling, the attention
    scale 256^-0.5); the vision tower is skipped."""
    text = dict(SHAPE, num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
                rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    ids = dict(image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, **ids)  # fmt: skip
    save_checkpoint(transformers.Gemma3ForConditionalGeneration(config), tmp_path, "5.x")
    d = json.loads((tmp_path / "config.json").read_text())
    d["text_config"] = {"model_type": "gemma3_text", **text}  # the hub's few keys
    (tmp_path / "config.json").write_text(json.dumps(d))
    ours = check_against_transformers(tmp_path, 4 * WINDOW + 1, None)
    assert ours.multimodal_checkpoint and ours.attn_scale == 256**-0.5
    assert ours.layer_windows == (WINDOW,) * 5 + (0,)
    assert (ours.rope_theta, ours.local_rope_theta) == (1e6, 1e4)
    assert ours.rope_scaling == {"rope_type": "linear", "factor": 8.0}


def save_checkpoint(hf, path, layout: str) -> None:
    """A transformers model, randomised, saved with a word-level tokenizer; for
    ``layout == "4.x"`` config.json is rewritten the way transformers 4 wrote it."""
    randomize(hf)
    hf.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    if layout == "4.x":
        d = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(to_4x_layout(d), indent=1))


def to_4x_layout(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    params = d.pop("rope_parameters")
    if FULL in params:  # Gemma 3: global RoPE at the top level, the local theta apart
        full, local = dict(params[FULL]), params[SW]
        d["rope_local_base_freq"] = local["rope_theta"]
        params = full
        d["sliding_window_pattern"] = d.pop("layer_types").index(FULL) + 1
    elif d["model_type"] in ("qwen2", "qwen3", "gemma2"):
        d.pop("layer_types")  # 4.x derived them (use_sliding_window, max_window_layers)
    params = dict(params)
    d["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params:
        d["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    kind = params.pop("rope_type")
    d["rope_scaling"] = None if kind == "default" else {"type": kind, **params}
    return d


def check_against_transformers(path, prompt_len: int, max_model_len: int | None) -> ModelConfig:
    """Load ``path`` with transformers and with us; compare a random prompt's logits, 16
    decode steps' logits and the engine's 16 greedy tokens (up to a tie:
    ``assert_greedy_matches``). Returns our config."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None  # 16 tokens, as ours with ignore_eos
    loaded = load_model(str(path), "cpu", torch.float32, "torch")
    if max_model_len:
        loaded.model.ensure_positions(max_model_len)
    prompt = torch.randint(3, VOCAB - 3, (prompt_len,)).tolist()
    ref.generation_config.eos_token_id = None  # a random model may pick EOS: generate on
    with torch.no_grad():
        full = ref(input_ids=torch.tensor([prompt])).logits[0]  # [L, V]
        gen = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)  # fmt: skip
    hf_tokens = gen.sequences[0, len(prompt) :].tolist()
    ours, steps = our_logits(loaded.model, prompt, hf_tokens)
    assert rel_err(ours[-1], full[-1]) < 1e-4, f"last token: {describe_diff(ours[-1], full[-1])}"
    assert rel_err(ours, full) < 1e-4, f"prompt logits: {describe_diff(ours, full)}"
    for i, (o, r) in enumerate(zip(steps, gen.logits, strict=True)):
        assert rel_err(o, r[0]) < 1e-4, f"decode step {i}: {describe_diff(o, r[0])}"
    llm = LLM(EngineConfig(
        model=str(path), device="cpu", dtype="float32", max_num_seqs=2,
        max_num_batched_tokens=CHUNK, max_model_len=max_model_len,
    ))  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    got = llm.generate([prompt], params)[0].token_ids
    assert_greedy_matches(got, hf_tokens, [r[0] for r in gen.logits])
    return loaded.config


@torch.no_grad()
def our_logits(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, list]:
    """Our logits of every prompt token ([L, V], one prefill), then after each of ``tokens``
    fed back one decode step at a time (teacher-forced), through one shuffled paged cache."""
    total = len(prompt) + len(tokens)
    table, num_blocks = block_tables([total], BLOCK, shuffle=True)
    caches = make_kv_caches(model, num_blocks, BLOCK)
    full = run_chunks(model, caches, table, [(prompt, 0)], BLOCK)[0]
    steps = [full[-1]]
    for i, t in enumerate(tokens[:-1]):
        steps.append(run_chunks(model, caches, table, [([t], len(prompt) + i)], BLOCK)[0][0])
    return full, steps


# ---- which layers slide, defaults, refusals ------------------------------------------------


@pytest.mark.parametrize("cls", [transformers.Qwen2Config, transformers.Qwen3Config])
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
        dict(use_sliding_window=False, sliding_window=64, max_window_layers=0),
        dict(use_sliding_window=True, sliding_window=None, max_window_layers=0),
        dict(use_sliding_window=True, sliding_window=32, max_window_layers=9),
        dict(use_sliding_window=True, sliding_window=32, max_window_layers=2,
             layer_types=[FULL, SW, FULL, SW]),
    ],
)  # fmt: skip
def test_qwen_windows_are_transformers(cls, kwargs):
    """Qwen2/Qwen3 slide the layers transformers' config says (layer_types), in both the 5.x
    file (layer_types written) and the 4.x one (derived from max_window_layers)."""
    hf = cls(**{**SHAPE, "num_hidden_layers": 4}, **kwargs)
    want = tuple(hf.sliding_window or 0 if t == SW else 0 for t in hf.layer_types)
    d = hf.to_dict()
    assert ModelConfig.from_hf_dict(d).layer_windows == want
    if "layer_types" not in kwargs:
        d.pop("layer_types")
        d["sliding_window"] = kwargs["sliding_window"]  # 4.x kept it when not in use
        assert ModelConfig.from_hf_dict(d).layer_windows == want


def test_keys_left_out_take_transformers_defaults():
    """A file without a key means the config class's default, as transformers reads it."""
    mistral = {"model_type": "mistral", **SHAPE}
    assert transformers.MistralConfig(**SHAPE).sliding_window == 4096
    assert ModelConfig.from_hf_dict(mistral).layer_windows == (4096, 4096)
    gemma2 = ModelConfig.from_hf_dict({"model_type": "gemma2", **SHAPE})
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.layer_windows == (4096, 0) and gemma2.head_dim == 256
    # "su": Phi-3's old name for longrope; the original length: Phi3Config's 4096
    su = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = ModelConfig.from_hf_dict({"model_type": "phi3", **SHAPE, "rope_scaling": su})
    assert phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 4096


def _refused(d: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict(d)


def test_what_is_refused_says_what_and_what_is_supported():
    llama = {"model_type": "llama", **SHAPE}
    _refused({"model_type": "qwen3_moe", **SHAPE}, r"'qwen3_moe' \(Qwen3-MoE .*supported: llama")
    _refused({"architectures": ["Olmo2ForCausalLM"], **SHAPE}, "unsupported model_type None")
    _refused({**llama, "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported; supported:")
    _refused({**llama, "mlp_bias": True}, "mlp_bias")
    _refused({**llama, "rope_scaling": {"type": "mrope", "factor": 2.0}},
             "unsupported rope_scaling type 'mrope'; supported: default, linear")  # fmt: skip
    _refused({**llama, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}},
             r"'longrope' lacks \['long_factor'\]")  # fmt: skip
    _refused({**llama, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3,
                                        "long_factor": [1.0] * 3}},
             "short_factor has 3 values, the rotary dims need 8")  # fmt: skip
    _refused({"model_type": "gemma3_text", **SHAPE, "use_bidirectional_attention": True},
             "use_bidirectional_attention")  # fmt: skip
    _refused({"model_type": "gemma2", **SHAPE, "layer_types": [FULL, "chunked_attention"]},
             r"layer_types must be 2 of .* got \['chunked_attention'\]")  # fmt: skip


def test_decode_roofline_counts_each_layers_window():
    """bench decode: a windowed layer reads the KV of its window's positions only."""
    from flashserve.bench.decode_ours import kv_bytes_read
    from flashserve.models.presets import preset_config

    gemma = preset_config("gemma3-12b").layer_windows  # 40 layers of 1,024, 8 global
    assert kv_bytes_read(gemma, 2.0, 4096) == 2.0 * (40 * 1024 + 8 * 4096)
    assert kv_bytes_read(gemma, 2.0, 100) == 2.0 * 48 * 100
    mistral = preset_config("mistral-7b-v0.1").layer_windows
    assert kv_bytes_read(mistral, 1.0, 131072) == 32 * 4096
    assert kv_bytes_read(preset_config("qwen3-8b").layer_windows, 1.0, 5000) == 36 * 5000
