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
HEAD_DIM_256 = {"gemma3-local-global-linear8", "qwen3-window-layer1"}


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
