"""GGUF files of each supported architecture, written here as llama.cpp's converter writes them
(tests/gguf_writer.py) from tiny random transformers models, against those models:

- the Hugging Face config dict read from the file means to transformers what the original
  config means (same ``to_dict()``), and gives the same ``ModelConfig``;
- the tensors come back with Hugging Face's names and values (exact in F32; Q8_0: the original
  stored and read back), and a transformers model built from the file's config and tensors
  gives the original's logits;
- our model loaded from the file: last-token logits within 1e-4 (relative) of transformers and
  the same 16 greedy tokens, prompts over 3x the window where there is one, prefilled in chunks
  that cross the window's edge.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf_writer import BOS, EOS, Q, converter_tensors, quantized, write_gguf
from model_utils import (
    TIE,
    assert_close,
    block_tables,
    describe_diff,
    make_kv_caches,
    run_chunks,
)

from flashserve.loaders import gguf as gguf_source
from flashserve.loaders.gguf_config import hf_config_dict
from flashserve.loaders.load import load_model
from flashserve.models.config import ModelConfig

# Q8_0 wants in-features that are multiples of 32.
TINY = dict(
    vocab_size=300,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
)
WINDOW = 8
GEMMA = dict(head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW)
# three decimals: the float32 GGUF values read back as these very numbers
_rng = np.random.default_rng(0)
SHORT = np.round(1 + 0.5 * _rng.random(12), 3).tolist()
LONG = np.round(1 + 4 * _rng.random(12), 3).tolist()

CASES = {
    "llama": (transformers.LlamaConfig, {}),
    "llama-bias-tied": (
        transformers.LlamaConfig,
        {"attention_bias": True, "tie_word_embeddings": True},
    ),
    "mistral-window": (transformers.MistralConfig, {"head_dim": 32, "sliding_window": WINDOW}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3-yarn": (
        transformers.Qwen3Config,
        {
            "head_dim": 48,  # not hidden / heads
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "gemma2": (
        transformers.Gemma2Config,
        {
            **GEMMA,
            "num_hidden_layers": 3,
            "attn_logit_softcapping": 5.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        {
            **GEMMA,
            "num_hidden_layers": 7,  # five local layers, a global one, a local one
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
            },
        },
    ),
    "phi3-longrope-partial": (
        transformers.Phi3Config,
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,  # 24 of 32 dims rotate: 12 factors
                "short_factor": SHORT,
                "long_factor": LONG,
            },
            "original_max_position_embeddings": 32,  # prompts are longer: long factors
        },
    ),
    "phi3-window": (transformers.Phi3Config, {"sliding_window": WINDOW}),
}
# (case, file type): every case in F32, two in Q8_0 (unpacked by torch: gguf_quants), one in
# MXFP4 (a type left to the gguf package's numpy)
FILES = [(c, "F32") for c in CASES] + [("qwen3-yarn", "Q8_0"), ("phi3-window", "Q8_0"),
                                       ("qwen3-yarn", "MXFP4")]  # fmt: skip
FILE_IDS = [f"{c}-{q}" for c, q in FILES]
# from_hf_dict's view of the transformers config and ours must agree on these; the rest of
# to_dict() is bookkeeping (architectures, dtype, ...) that a GGUF file does not carry
_IGNORED_KEYS = {"architectures", "dtype", "_name_or_path", "transformers_version"}


def make_hf(case: str):
    """A random tiny transformers model of ``case``; norm weights around Gemma's 0 or 1."""
    cls, extra = CASES[case]
    hf = transformers.AutoModelForCausalLM.from_config(cls(**{**TINY, **extra}))
    gen = torch.Generator().manual_seed(0)
    gemma = hf.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise / p.shape[1] ** 0.5 * (3.0 if "embed" in name else 1.0))
            elif "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            else:
                p.copy_(0.1 * noise)
    return hf.eval()


@pytest.fixture
def case_file(tmp_path, request):
    """(transformers model, GGUF path, file type) of a ``FILES`` entry."""
    case, qtype = request.param
    hf = make_hf(case)
    path = tmp_path / f"{case}.gguf"
    write_gguf(path, hf, Q[qtype])
    return hf, path, qtype


def hf_from_dict(d: dict):
    return transformers.AutoConfig.for_model(**d)


# ---- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case_file", FILES[: len(CASES)], ids=list(CASES), indirect=True)
def test_config_dict_means_the_original_config(case_file):
    hf, path, _ = case_file
    ours = gguf_source.read_hf_config(gguf_source.open_file(path))
    assert ours["model_type"] == hf.config.model_type
    mine = transformers.AutoConfig.for_model(**ours).to_dict()
    theirs = hf.config.to_dict()
    differ = {
        key: (mine.get(key), theirs.get(key))
        for key in (mine.keys() | theirs.keys()) - _IGNORED_KEYS
        if mine.get(key) != theirs.get(key)
    }
    assert not differ, f"ours vs the original: {differ}"


@pytest.mark.parametrize("case_file", FILES[: len(CASES)], ids=list(CASES), indirect=True)
def test_model_config_equals_the_original(case_file):
    hf, path, _ = case_file
    ours = gguf_source.read_config(gguf_source.open_file(path), name="tiny")
    assert ours == ModelConfig.from_hf_dict(hf.config.to_dict(), name="tiny")


# ---- tensors ---------------------------------------------------------------------------------


def expected_state_dict(hf, qtype: str) -> dict[str, torch.Tensor]:
    """``hf``'s tensors as a GGUF file of ``qtype`` gives them back (tied lm_head left out)."""
    out = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        t = t.float()
        if t.dim() == 2 and qtype != "F32":
            t = torch.from_numpy(quantized(t.numpy(), Q[qtype]))
        out[name] = t
    return out


@pytest.mark.parametrize("case_file", FILES, ids=FILE_IDS, indirect=True)
def test_tensors_come_back_in_hugging_face_layout(case_file):
    hf, path, qtype = case_file
    file = gguf_source.open_file(path)
    config = hf_from_dict(gguf_source.read_hf_config(file))
    ours = dict(gguf_source.iter_weights(file, config))
    want = expected_state_dict(hf, qtype)
    assert sorted(ours) == sorted(want)
    for name, ref in want.items():
        got = ours[name]
        assert got.shape == ref.shape, f"{name}: {tuple(got.shape)} vs {tuple(ref.shape)}"
        if hf.config.model_type.startswith("gemma") and name.endswith("norm.weight"):
            got, ref = got + 1, ref + 1  # the model uses 1 + w: that is exact, w need not be
        assert torch.equal(got, ref), f"{name}: {describe_diff(got, ref)}"


@pytest.mark.parametrize("case_file", FILES, ids=FILE_IDS, indirect=True)
def test_transformers_from_the_file_matches_the_original(case_file):
    """transformers' own model, built from the file's config dict and tensors, gives the
    original's logits: the translation is complete, with nothing left to our model."""
    hf, path, qtype = case_file
    file = gguf_source.open_file(path)
    config = hf_from_dict(gguf_source.read_hf_config(file))
    rebuilt = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = rebuilt.load_state_dict(
        dict(gguf_source.iter_weights(file, config)), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if qtype != "F32":
        hf.load_state_dict(expected_state_dict(hf, qtype), strict=False)
    prompt = torch.randint(0, TINY["vocab_size"], (1, 5 * WINDOW))
    with torch.no_grad():
        ref, got = hf(input_ids=prompt).logits[0], rebuilt(input_ids=prompt).logits[0]
    assert torch.allclose(got, ref, rtol=0, atol=1e-5), describe_diff(got, ref)


def test_converter_writes_what_the_loader_names():
    """Every GGUF name the converter gives a case's tensors maps back to the original name."""
    for case in CASES:
        hf = make_hf(case)
        arch = {"mistral": "llama", "gemma3_text": "gemma3"}.get(hf.config.model_type)
        arch = arch or hf.config.model_type
        back = {gguf_source.hf_name(n, arch) for n, _ in converter_tensors(hf)}
        back -= {"rope_factors_long.weight", "rope_factors_short.weight"}
        assert back == set(expected_state_dict(hf, "F32")), case


# ---- our model, end to end -------------------------------------------------------------------


@torch.no_grad()
def ours_teacher_forced(model, prompt: list[int], forced: list[int], chunk: int, block_size=16):
    """Our model: the prompt prefilled in chunks of ``chunk`` tokens, then one decode step for
    each token of ``forced`` but the last (fed whatever our own argmax would be), through paged
    KV caches with shuffled blocks. Returns the logits of the prompt's last token and of each
    step, ``[len(forced), V]``: the next-token logits wherever ``forced`` is the reference's
    greedy sequence."""
    total = len(prompt) + len(forced)
    table, num_blocks = block_tables([total], block_size, True, torch.Generator().manual_seed(0))
    caches = make_kv_caches(model, num_blocks, block_size)
    for start in range(0, len(prompt), chunk):
        ids = prompt[start : start + chunk]
        last = run_chunks(model, caches, table, [(ids, start)], block_size)[0][-1]
    out = [last]
    for i, token in enumerate(forced[:-1]):
        out.append(
            run_chunks(model, caches, table, [([token], len(prompt) + i)], block_size)[0][-1]
        )
    return torch.stack(out)


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """transformers, recomputing the whole sequence each step (no cache): each step's
    next-token logits ``[steps, V]`` and the greedy tokens."""
    ids, logits, tokens = list(prompt), [], []
    for _ in range(steps):
        logits.append(hf(input_ids=torch.tensor([ids])).logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
        ids.append(tokens[-1])
    return torch.stack(logits), tokens


@pytest.mark.parametrize("case_file", FILES, ids=FILE_IDS, indirect=True)
def test_our_model_from_the_file_matches_transformers(case_file):
    """transformers' greedy continuation fed to our model (prefilled in chunks, then decoded):
    every step's logits within 1e-4, and every step's argmax transformers' token unless the two
    logits tie (``TIE``)."""
    hf, path, qtype = case_file
    if qtype != "F32":  # the reference holds the weights as the file stores them
        hf.load_state_dict(expected_state_dict(hf, qtype), strict=False)
    loaded = load_model(str(path), "cpu", torch.float32, "torch")
    assert loaded.config.bos_token_id == BOS and loaded.config.eos_token_ids == [EOS]
    prompt = torch.randint(0, TINY["vocab_size"], (5 * WINDOW,)).tolist()
    ref_logits, ref_tokens = hf_greedy(hf, prompt, 16)
    logits = ours_teacher_forced(loaded.model, prompt, ref_tokens, chunk=WINDOW + 5)
    assert_close(list(logits), list(ref_logits), 1e-4)
    for step, (ours, ref, token) in enumerate(zip(logits, ref_logits, ref_tokens, strict=True)):
        pick = int(ours.argmax())
        assert pick == token or ref[token] - ref[pick] < TIE, (step, pick, token, ref[pick])


# ---- what the metadata alone decides ---------------------------------------------------------


def gemma_meta(arch: str, layers: int, **extra) -> dict:
    meta = {
        "general.architecture": arch,
        f"{arch}.embedding_length": 4608,
        f"{arch}.feed_forward_length": 36864,
        f"{arch}.block_count": layers,
        f"{arch}.attention.head_count": 32,
        f"{arch}.attention.head_count_kv": 16,
        f"{arch}.attention.key_length": 128,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.attention.sliding_window": 4096,
    }
    return {**meta, **{f"{arch}.{k}": v for k, v in extra.items()}}


SHAPES = {"token_embd.weight": (4608, 256000)}


@pytest.mark.parametrize(
    "arch, layers, want", [("gemma2", 46, 144), ("gemma2", 42, 128), ("gemma3", 62, 144)]
)
def test_gemma_query_scale_follows_llamacpp(arch, layers, want):
    """llama.cpp scales queries by hidden/heads in the 27B models, by the head dim otherwise."""
    d = hf_config_dict(gemma_meta(arch, layers), SHAPES)
    assert d["query_pre_attn_scalar"] == want
    d = hf_config_dict(gemma_meta(arch, layers, **{"attention.scale": 1 / 12}), SHAPES)
    assert d["query_pre_attn_scalar"] == 144


def test_gemma3_layer_pattern_and_local_rope():
    d = hf_config_dict(gemma_meta("gemma3", 12, **{"rope.freq_base": 1e6}), SHAPES)
    assert [i for i, t in enumerate(d["layer_types"]) if t == "full_attention"] == [5, 11]
    assert d["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert d["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    meta = gemma_meta("gemma3", 4, **{"attention.sliding_window_pattern": [True, False] * 2})
    meta.pop("gemma3.attention.sliding_window")  # no window: every layer global
    assert set(hf_config_dict(meta, SHAPES)["layer_types"]) == {"full_attention"}


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"general.architecture": "falcon"},
            r"general.architecture 'falcon' is not supported; "
            r"supported: llama, qwen2, qwen3, gemma2, gemma3, phi3",
        ),
        ({"gemma2.embedding_length": None}, r"lacks gemma2.embedding_length"),
        ({"gemma2.rope.scaling.type": "dynamic"}, r"rope.scaling.type 'dynamic' is not supported"),
        ({"gemma2.attention.head_count_kv": [16, 8]}, r"head_count_kv varies by layer"),
    ],
)
def test_untranslatable_metadata_is_named(change, error):
    meta = {**gemma_meta("gemma2", 42), **change}
    meta = {k: v for k, v in meta.items() if v is not None}
    with pytest.raises(ValueError, match=error):
        hf_config_dict(meta, SHAPES)


def test_unsupported_architecture_file_is_one_line_error(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((300, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"^GGUF general.architecture 'falcon' is not supported"):
        load_model(str(path), "cpu", torch.float32, "torch")
