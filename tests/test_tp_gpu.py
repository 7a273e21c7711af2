"""Tensor parallelism on two GPUs (NCCL, Triton backend); skipped with fewer than two.

- bf16, eager and under CUDA graphs (with async scheduling, and on sm_90+ the PDL chain,
  their defaults): every token the two-rank engine picks is the one-GPU engine's argmax to
  within bf16 rounding of its logits, the same tokens fed to both (teacher forcing, as
  tests/test_engine_gpu.py does for Triton against torch): the ranks' partial sums round
  differently, so the tokens may part where two logits are within rounding;
- float32 on two ranks: CUDA graphs with async scheduling (the collectives captured, the
  look-ahead steps' tokens broadcast on the device) give the plain eager engine's tokens;
- the PDL chain on and off give the same bf16 tokens under graphs, twice over (a kernel that
  did not wait for the all-reduce before it would be a race).
"""

from __future__ import annotations

import gc
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_engine_gpu import BF16_LOGIT_SLACK, _teacher_forced_logits
from test_model_archs import save_checkpoint

from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.sampling.params import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

# Qwen2 (q/k/v biases), head dim 64, two KV heads (one per rank), a vocabulary that does not
# split evenly (the last rank's rows padded)
SHAPE = dict(
    vocab_size=32003,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
ROOT = Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-tp")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SHAPE))
    save_checkpoint(hf, path, "5.x")  # randomised (model_utils.randomize): peaked logits
    return str(path)


@pytest.fixture(scope="module")
def prompts():
    return [[random.randrange(3, 32000) for _ in range(n)] for n in (5, 300, 1200, 40)]


def _llm(path: str, **kwargs) -> LLM:
    # an explicit pool: several engines are built one after another in this process
    return LLM(EngineConfig(model=path, max_model_len=2048, max_kv_tokens=1 << 15,
                            max_num_seqs=8, **kwargs))  # fmt: skip


def _generate(path: str, prompts, params=GREEDY, **kwargs) -> list[list[int]]:
    with _llm(path, **kwargs) as llm:
        out = [c.token_ids for c in llm.generate(prompts, params)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_bf16_two_ranks_pick_one_gpu_s_argmax_within_rounding(checkpoint, prompts, enforce_eager):
    generated = _generate(checkpoint, prompts, tensor_parallel_size=2,
                          enforce_eager=enforce_eager)  # fmt: skip
    with _llm(checkpoint, enforce_eager=True) as one:
        for prompt, tokens in zip(prompts, generated):
            logits = _teacher_forced_logits(one, prompt + tokens)[len(prompt) - 1 : -1]
            chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
            gap = logits.max(dim=1).values - chosen  # >= 0; 0 where one GPU agrees exactly
            assert gap.max().item() <= BF16_LOGIT_SLACK, (tokens, gap.tolist())


def test_fp32_two_ranks_cuda_graphs_and_async_equal_eager(checkpoint, prompts):
    """Decode batches shrink as prompts finish; two are sampled (seeded: rank 0 samples the
    gathered logits)."""
    params = [SamplingParams(max_new_tokens=random.randint(4, 30), temperature=0,
                             ignore_eos=True) for _ in prompts]  # fmt: skip
    params[1] = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=3,
                               ignore_eos=True)  # fmt: skip
    tp = dict(tensor_parallel_size=2, dtype="float32")
    eager = _generate(checkpoint, prompts, params, enforce_eager=True, async_scheduling=False,
                      **tp)  # fmt: skip
    graphs = _generate(checkpoint, prompts, params, async_scheduling=True, **tp)
    assert graphs == eager


def test_pdl_chain_on_two_ranks_gives_the_same_tokens(checkpoint, prompts):
    from kernels import common

    if not common.pdl_chain(torch.device("cuda"), True):
        pytest.skip("programmatic dependent launch needs sm_90+")
    plain = _generate(checkpoint, prompts, tensor_parallel_size=2, pdl_chain=False)
    for _ in range(2):
        assert _generate(checkpoint, prompts, tensor_parallel_size=2, pdl_chain=True) == plain


ONE_ENGINE = """
import json, sys
from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.sampling.params import SamplingParams
path, setting, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = EngineConfig(model=path, max_model_len=2048, max_kv_tokens=1 << 15, max_num_seqs=8,
                      tensor_parallel_size=2, tp_all_reduce=setting)
with LLM(config) as llm:
    one_shot = llm.engine.runner.tp.one_shot is not None
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    tokens = [c.token_ids for c in llm.generate(prompts, params)]
print(json.dumps({"one_shot": one_shot, "tokens": tokens}))
"""


def _fresh_process_tokens(checkpoint, prompts, setting: str) -> dict:
    """One TP engine in a process of its own (torch allows one symmetric-memory rendezvous
    sequence per process: ``parallel.one_shot_refusal``), bf16 with CUDA graphs."""
    r = subprocess.run([sys.executable, "-c", ONE_ENGINE, checkpoint, setting,
                        json.dumps(prompts)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_shot_all_reduce_gives_nccl_s_tokens(checkpoint, prompts):
    """tp_all_reduce auto takes the one-shot kernel (decode steps' all-reduces, captured in the
    graphs) and picks NCCL's tokens exactly: on two ranks a sum of two is the same rounding
    whichever kernel adds it."""
    auto = _fresh_process_tokens(checkpoint, prompts, "auto")
    nccl = _fresh_process_tokens(checkpoint, prompts, "nccl")
    assert auto["one_shot"] and not nccl["one_shot"]
    assert auto["tokens"] == nccl["tokens"]
