"""The sm_90 prefill paths in the engine (``--prefill-path hopper`` / ``gluon``): a bf16 model
with head dim 128 in 128-token blocks, prompts prefilled in 512-token chunks over their cached
context, a second request starting on the first's cached blocks (prefix caching); the Hopper
path over an fp8 cache too, against the portable path over the same. Each greedy
token is, teacher-forced through the portable path, within bf16 rounding of its best logit,
and a whole prompt's logits match the portable path's. Run on the GPU machine:
``python3 -m pytest -q -m gpu tests/test_prefill_paths_gpu.py``."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers
import triton
from model_utils import rel_err
from test_engine_gpu import _teacher_forced_logits
from test_model_archs import SHAPE, save_checkpoint

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.sampling.params import SamplingParams
from kernels.prefill_paths import gluon_triton_refusal

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = transformers.LlamaConfig(**{**SHAPE, "head_dim": 128,
                                         "max_position_embeddings": 4096})  # fmt: skip
    path = tmp_path_factory.mktemp("llama-d128")
    save_checkpoint(transformers.LlamaForCausalLM(config), path, "5.x")
    return str(path)


def _engine(checkpoint: str, path: str, kv: str = "auto") -> LLM:
    return LLM(EngineConfig(model=checkpoint, device="cuda", dtype="bfloat16", block_size=128,
                            max_num_batched_tokens=512, max_model_len=4096, max_num_seqs=4,
                            max_kv_tokens=16384, prefill_path=path,
                            kv_cache_dtype=kv))  # fmt: skip


def _free() -> None:
    """After ``del`` of the last engine reference: its pools and graphs go now."""
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("path, kv", [("hopper", "auto"), ("gluon", "auto"), ("hopper", "fp8")])
def test_sm90_prefill_path_gives_the_portable_paths_tokens_and_logits(checkpoint, path, kv):
    """kv fp8: the same e4m3 cache (and its scales) read by the Hopper path and the portable
    one."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper and Gluon prefill paths run on sm_90")
    if path == "gluon" and gluon_triton_refusal(triton.__version__):
        pytest.skip(gluon_triton_refusal(triton.__version__))
    gen = torch.Generator().manual_seed(2)
    head = torch.randint(3, 500, (1100,), generator=gen).tolist()
    first = head + torch.randint(3, 500, (400,), generator=gen).tolist()
    later = [head + torch.randint(3, 500, (250,), generator=gen).tolist(),
             torch.randint(3, 500, (777,), generator=gen).tolist()]  # fmt: skip
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    llm = _engine(checkpoint, path, kv)
    outs = llm.generate([first], params)
    hits = llm.engine.scheduler.prefix_cache_hits
    outs += llm.generate(later, params)
    assert llm.engine.scheduler.prefix_cache_hits - hits == 1024  # 8 blocks of 128 reused
    whole = _teacher_forced_logits(llm, first)
    del llm
    _free()
    ref = _engine(checkpoint, "portable", kv)
    assert rel_err(whole, _teacher_forced_logits(ref, first)) < 2e-2
    for prompt, out in zip([first, *later], outs):
        tokens = out.token_ids
        logits = _teacher_forced_logits(ref, prompt + tokens)[len(prompt) - 1 : -1]
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen  # >= 0
        slack = 0.02 * logits.abs().max(dim=1).values + 0.1  # a few bf16 spacings
        assert (gap <= slack).all(), (path, tokens, gap.tolist())
    del ref
    _free()
