"""``--tp-all-reduce fused`` on two GPUs (``kernels.fold``: the all-reduce folded into the
row-parallel GEMV and the norm after it); skipped with fewer than two.

- the kernels on two ranks through the engine's group (``tests/tp_fold_ranks.py``): every
  folded call, eager and replayed from a CUDA graph, gives what NCCL's all-reduce and the
  unfolded norm give on the same GEMV outputs, bit for bit, with rank 1 held back (a sleep
  kernel) before some of its GEMVs, and no norm gives up waiting;
- the engine: greedy tokens with the fold equal NCCL's exactly (two ranks: a sum of two
  rounds the same whoever adds it), bf16, eager and under CUDA graphs (PDL chain on where
  the GPU has it), for Qwen2 (Llama's layer) and Gemma 3 (the sandwich norms: the output norm
  of the whole sum); each engine in a process of its own (one symmetric-memory rendezvous a
  process: ``parallel.one_shot_refusal``).

Run on the GPU machine: ``python3 -m pytest -q -m gpu tests/test_tp_fold_gpu.py``
(``docs/benchmarks/device/tp_fold.sh``).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_model_archs import CASES, save_checkpoint
from test_model_archs import SHAPE as ARCH_SHAPE
from test_tp_gpu import SHAPE

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]
ROOT = Path(__file__).resolve().parents[1]


def test_folded_kernels_on_two_ranks_give_nccl_s_sums(tmp_path):
    out = tmp_path / "ranks.json"
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_fold_ranks.py"), str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    ranks = json.loads(out.read_text()) if out.exists() else {}
    assert r.returncode == 0 and len(ranks) == 2, (r.stderr[-4000:], ranks)
    for rank, found in ranks.items():
        report = found["report"]
        bad = [c for c in report["eager"] + report["graph"] if c["differ"]]
        assert not bad, (rank, bad)
        assert len(report["eager"]) == 7 and len(report["graph"]) == 12, report
        assert report["status"] == 0, (rank, report["status"])


ONE_ENGINE = """
import json, sys
from flashserve.config import EngineConfig
from flashserve.engine.llm_engine import LLM
from flashserve.sampling.params import SamplingParams
path, setting, eager = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
prompts = json.loads(sys.argv[4])
config = EngineConfig(model=path, max_model_len=2048, max_kv_tokens=1 << 15, max_num_seqs=8,
                      tensor_parallel_size=2, tp_all_reduce=setting, enforce_eager=eager)
with LLM(config) as llm:
    fused = llm.engine.runner.tp.fused
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    tokens = [c.token_ids for c in llm.generate(prompts, params)]
    status = None if fused is None else fused.status.item()
    calls = None if fused is None else fused.calls.item()
print(json.dumps({"fused": fused is not None, "status": status, "calls": calls,
                  "tokens": tokens}))
"""


def _tokens(checkpoint: str, prompts, setting: str, eager: bool) -> dict:
    r = subprocess.run([sys.executable, "-c", ONE_ENGINE, checkpoint, setting,
                        "1" if eager else "0", json.dumps(prompts)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    qwen = tmp_path_factory.mktemp("qwen2-fold")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**SHAPE))
    save_checkpoint(hf, qwen, "5.x")
    case = CASES["gemma3-local-global-linear8"]
    gemma = tmp_path_factory.mktemp("gemma3-fold")
    config = case.cls(**{**ARCH_SHAPE, **case.kwargs})
    save_checkpoint(transformers.AutoModelForCausalLM.from_config(config), gemma, "5.x")
    return {"qwen2": str(qwen), "gemma3": str(gemma)}


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "cuda-graphs"])
def test_fused_all_reduce_gives_nccl_s_tokens(checkpoints, arch, eager):
    """Prompts of 5 to 1200 tokens (prefill steps on NCCL, decode batches of 1 to 4 folded)."""
    vocab = SHAPE["vocab_size"] if arch == "qwen2" else ARCH_SHAPE["vocab_size"]
    prompts = [[random.randrange(3, vocab - 1) for _ in range(n)] for n in (5, 300, 1200, 40)]
    fused = _tokens(checkpoints[arch], prompts, "fused", eager)
    nccl = _tokens(checkpoints[arch], prompts, "nccl", eager)
    assert fused["fused"] and not nccl["fused"]
    assert fused["status"] == 0 and fused["calls"] > 0, fused
    assert fused["tokens"] == nccl["tokens"]
