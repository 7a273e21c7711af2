"""The new architectures on CUDA: the Triton backend (windows, soft-caps, q/k norms, Gemma's
norms, GELU gating, partial rotary, head dim 256) gives the torch backend's greedy tokens, eager
and under CUDA graphs, past the window, with prefill chunks that cross its edge. float32, tiny
checkpoints written by transformers (the same cases ``tests/test_model_archs.py`` holds against
transformers on the CPU). Run on the GPU machine: ``python3 -m pytest -q -m gpu``."""

from __future__ import annotations

import pytest
import torch
import transformers
from test_model_archs import CASES, CHUNK, NEW_TOKENS, SHAPE, save_checkpoint

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu

NAMES = ["qwen3-window-layer1", "mistral-window", "gemma2", "gemma3-local-global-linear8",
         "phi3-longrope-short-partial"]  # fmt: skip
HEAD_DIM_256 = ["gemma3-local-global-linear8", "qwen3-window-layer1"]  # a list: one order a run


@pytest.fixture(scope="module", params=[*NAMES, *(f"{n}@256" for n in HEAD_DIM_256)])
def checkpoint(request, tmp_path_factory):
    name, _, head_dim = request.param.partition("@")
    case = CASES[name]
    kwargs = dict(case.kwargs)
    if head_dim:
        kwargs["head_dim"] = int(head_dim)
    config = case.cls(**{**SHAPE, **kwargs})
    path = tmp_path_factory.mktemp(request.param.replace("@", "-"))
    save_checkpoint(transformers.AutoModelForCausalLM.from_config(config), path, "5.x")
    return str(path), case


def _generate(path: str, case, backend: str, eager: bool, prompts, max_num_seqs: int):
    llm = LLM(EngineConfig(model=path, device="cuda", dtype="float32", attention_backend=backend,
                           enforce_eager=eager, max_num_batched_tokens=CHUNK,
                           max_model_len=case.max_model_len or 256,
                           max_num_seqs=max_num_seqs, max_kv_tokens=8192))  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    del llm
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs], [lp for o in outs for lp in o.logprobs]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_triton_gives_the_torch_backends_tokens(checkpoint, eager):
    path, case = checkpoint
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (case.prompt_len - 5 * i,), generator=gen).tolist()
               for i in range(3)]  # fmt: skip
    want, want_lp = _generate(path, case, "torch", True, prompts, 4)
    got, got_lp = _generate(path, case, "triton", eager, prompts, 4)
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=2e-3)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
def test_bf16_triton_tokens_are_torch_argmax_within_rounding(checkpoint, eager):
    """bfloat16: the backends round differently, so a near-tie may go either way; each token
    the Triton engine picks is, teacher-forced through the torch backend, within bf16 rounding
    of its best logit (a window ignored or misplaced moves logits by far more)."""
    from test_engine_gpu import _teacher_forced_logits

    path, case = checkpoint
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (case.prompt_len,), generator=gen).tolist()]
    config = dict(model=path, device="cuda", dtype="bfloat16", max_num_batched_tokens=CHUNK,
                  max_model_len=case.max_model_len or 256, max_num_seqs=4,
                  max_kv_tokens=8192)  # fmt: skip
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    llm = LLM(EngineConfig(**config, attention_backend="triton", enforce_eager=eager))
    tokens = llm.generate(prompts, params)[0].token_ids
    del llm
    ref = LLM(EngineConfig(**config, attention_backend="torch", enforce_eager=True))
    logits = _teacher_forced_logits(ref, prompts[0] + tokens)[len(prompts[0]) - 1 : -1]
    chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    gap = logits.max(dim=1).values - chosen  # >= 0; 0 where torch agrees exactly
    slack = 0.02 * logits.abs().max(dim=1).values + 0.1  # a few bf16 spacings of the logits
    assert (gap <= slack).all(), (tokens, gap.tolist(), slack.tolist())
