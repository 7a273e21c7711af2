"""``--quantization fp8`` end to end on the CPU: the option, the engine's greedy tokens next to
the unquantized model's, dummy weights quantized at load, and the decode roofline's bytes.

A float8 model's tokens are not the unquantized model's (e4m3 moves each weight by up to
1/16): the check is teacher-forced. The unquantized model reads the fp8 engine's output and
each token the fp8 engine chose must be its argmax or close to it (tiny random Llama, logits
of std ~1: measured gaps up to 0.28 over 6 seeds; a wrong scale gives gaps of ~2).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from model_utils import TINY, randomize, run_prompts
from test_fp8_loading import write_tokenizer

from flashserve.bench.decode_ours import weight_bytes_read
from flashserve.cli.args import add_engine_args, engine_config_from_args
from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM, LLMEngine
from flashserve.loaders.load import load_model
from flashserve.sampling.params import SamplingParams
from kernels.quant import E4M3, dequantize

GAP_SLACK = 0.6  # logits (std ~1) of the tiny random model


@pytest.fixture
def tiny_dir(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    randomize(hf, seed=int(torch.randint(0, 2**30, ())))
    hf.save_pretrained(tmp_path)
    write_tokenizer(tmp_path)
    return tmp_path


def test_engine_greedy_tokens_close_to_unquantized(tiny_dir):
    llm = LLM(EngineConfig(model=str(tiny_dir), quantization="fp8", max_kv_tokens=2048))
    linear = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert linear.weight.dtype == E4M3 and linear.weight_scale.shape == (TINY["hidden_size"],)
    prompts = [torch.randint(3, 512, (n,)).tolist() for n in (3, 20, 45)]
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    outs = [c.token_ids for c in llm.generate(prompts, params)]
    assert [len(o) for o in outs] == [16] * 3
    ref = load_model(str(tiny_dir), "cpu", torch.float32, "torch").model
    agree = []
    for prompt, out in zip(prompts, outs):
        logits = run_prompts(ref, [prompt + out])[0][len(prompt) - 1 : -1]  # [16, V]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert gap.max().item() <= GAP_SLACK, gap.tolist()
        agree.append((gap == 0).float().mean().item())
    assert sum(agree) / len(agree) >= 0.5, agree


def test_dummy_weights_are_the_unquantized_ones_quantized():
    """``dummy:`` presets under ``--quantization fp8`` draw the same numbers as without, then
    quantize them: each weight within e4m3's 1/16 of its unquantized twin."""
    plain = load_model("dummy:tiny", "cpu", torch.float32, "torch", seed=5).model
    fp8 = load_model("dummy:tiny", "cpu", torch.float32, "torch", seed=5, quantization="fp8")
    fp8 = fp8.model
    for a, b in zip(plain.linears(), fp8.linears()):
        assert b.weight.dtype == E4M3
        w = dequantize(b.weight, b.weight_scale, torch.float32)
        bound = torch.maximum(a.weight.abs() / 16, b.weight_scale[:, None] / 1024) * 1.0001
        assert ((w - a.weight).abs() <= bound).all()
    assert torch.equal(plain.model.embed_tokens.weight, fp8.model.embed_tokens.weight)
    assert torch.equal(plain.lm_head.weight, fp8.lm_head.weight)


def test_decode_roofline_counts_fp8_bytes():
    """``bench decode``'s weight bytes: one per fp8 weight plus its float32 scales, the rest
    (LM head, norms) at the model's dtype; the untied input embeddings not at all."""
    kw = dict(model="dummy:tiny", max_kv_tokens=256, max_num_seqs=2)
    plain = LLMEngine(EngineConfig(**kw))
    fp8 = LLMEngine(EngineConfig(**kw, quantization="fp8"))
    model = fp8.runner.model
    projections = sum(m.weight.numel() for m in model.linears())
    scales = sum(m.weight_scale.numel() for m in model.linears())
    # float32 on the CPU: each projection weight goes from 4 bytes to 1, plus 4 per row
    assert weight_bytes_read(fp8) == weight_bytes_read(plain) - 3 * projections + 4 * scales
    assert scales == sum(m.out_features for m in model.linears())


def test_quantization_option():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert (
        engine_config_from_args(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    )
    assert engine_config_from_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="int4")
