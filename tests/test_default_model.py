"""The default model (SmolLM2-135M-Instruct, the packaged GGUF file) against transformers' own
model loaded from the same file: logits, and greedy generation through the engine.

transformers' model is built once here (30 s on two cores: it reads the file's metadata twice);
``make test`` hands pytest-xdist's workers whole files, so it is built on one worker only.
"""

from __future__ import annotations

import pytest
import torch
from model_utils import assert_close, hf_logits, run_prompts

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.loaders.load import default_model_path, load_model
from flashserve.sampling.params import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_default_model():
    """transformers' SmolLM2-135M-Instruct from the packaged GGUF file, float32, eval mode."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def test_default_model_logits_match_transformers(hf_default_model):
    ours = load_model(None, "cpu", torch.float32, "torch")
    prompt = torch.randint(0, ours.config.vocab_size, (40,)).tolist()
    assert_close(run_prompts(ours.model, [prompt]), hf_logits(hf_default_model, [prompt]), 1e-4)


def test_greedy_matches_transformers_generate(hf_default_model):
    llm = LLM(EngineConfig(max_num_seqs=16))
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(question))
    ours = llm.generate([ids], SamplingParams(max_new_tokens=32, temperature=0))[0]
    with torch.no_grad():
        hf = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    expected = hf[0, len(ids) :].tolist()
    assert ours.token_ids == expected, f"ours {ours.token_ids}\nhf   {expected}"
    assert "Paris" in ours.text
