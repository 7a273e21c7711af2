"""One step pipeline on ``dummy:tiny`` (CPU): every step, eager or graph, plain or queued ahead,
sends its inputs (model, attention metadata, sampler) in one upload; the graph path (static
buffers written through the backend's replay hook, padded buckets, tokens gathered on the
device for a look-ahead step) gives the eager path's tokens.

CUDA graphs cannot run here, so ``_capture_on_cpu`` stands in for the capture: each bucket's
"graph" runs the very function captured on CUDA (``DecodeGraphs._forward``, over the static
buffers) again at replay, into the tensors it returned at capture. tests/test_engine_gpu.py
runs the real graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

from flashserve.config import EngineConfig
from flashserve.engine import cuda_graph
from flashserve.engine.cuda_graph import DecodeGraphs
from flashserve.engine.llm_engine import LLM
from flashserve.engine.staging import Upload
from flashserve.sampling.params import SamplingParams

PARAMS = [
    SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True),
    SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
    SamplingParams(
        max_new_tokens=12, temperature=1.1, top_k=20, min_p=0.05, seed=2, ignore_eos=True
    ),  # fmt: skip
    SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True),
]
WITH_PENALTIES = [
    SamplingParams(
        max_new_tokens=8,
        temperature=0.9,
        seed=3,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        ignore_eos=True,
    ),  # fmt: skip
    SamplingParams(
        max_new_tokens=8, temperature=0, logprobs=2, frequency_penalty=0.4, ignore_eos=True
    ),  # fmt: skip
]


def _llm(**kwargs) -> LLM:
    """Eager unless a test installs ``_with_cpu_graphs``: on CUDA the real graphs would replay
    without calling the model's ``forward`` in Python."""
    given = {
        "max_num_seqs": 16,
        "max_kv_tokens": 8192,
        "async_scheduling": False,
        "enforce_eager": True,
        **kwargs,
    }
    return LLM(EngineConfig(model="dummy:tiny", **given))


def _prompts(n: int) -> list[list[int]]:
    return [[random.randrange(3, 500) for _ in range(random.randint(1, 40))] for _ in range(n)]


class _Replay:
    """What the runner uses of a ``torch.cuda.CUDAGraph``, on the CPU: ``replay`` runs the
    captured function again and writes its results into the tensors captured."""

    def __init__(self, fn):
        self.fn = fn
        self.outputs = fn()

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


@torch.inference_mode()
def _capture_on_cpu(graphs: DecodeGraphs) -> None:
    for b in graphs.buckets:
        graph = _Replay(lambda b=b: graphs._forward(b))
        graphs.graphs[b] = (graph, *graph.outputs)


def _greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.sampling.greedy_sample`` in torch: argmax and its log-softmax."""
    ids = logits.argmax(dim=-1)
    return ids, logits.log_softmax(dim=-1).gather(1, ids[:, None])[:, 0]


def _with_cpu_graphs(monkeypatch, llm: LLM) -> DecodeGraphs:
    monkeypatch.setattr(DecodeGraphs, "_capture_all", _capture_on_cpu)
    monkeypatch.setattr(cuda_graph, "greedy_sample", _greedy_sample)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner)
    return runner.graphs


def _count(monkeypatch, llm: LLM) -> dict[str, int]:
    """Forward passes of the model (eager, or a graph replaying it) and host-to-device copies
    of every staging (the runner's, the graphs', the sampler's own)."""
    runner = llm.engine.runner
    counts = {"forwards": 0}
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda *a: (counts.__setitem__(
        "forwards", counts["forwards"] + 1), forward(*a))[1])  # fmt: skip
    return counts


def _copies(llm: LLM) -> int:
    runner = llm.engine.runner
    stagings = [runner.staging, runner.sampler._staging]
    if runner.graphs is not None:
        stagings.append(runner.graphs.staging)
    return sum(s.num_copies for s in stagings if s is not None)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_one_upload_per_step(monkeypatch, async_scheduling, graphs):
    """Greedy, sampled, penalised and logprob rows, prefill chunks and decodes: each forward
    pass had exactly one host-to-device copy, the sampler's inputs included."""
    llm = _llm(async_scheduling=async_scheduling, max_num_batched_tokens=32)
    if graphs:
        _with_cpu_graphs(monkeypatch, llm)
    counts = _count(monkeypatch, llm)
    before = _copies(llm)
    llm.generate(_prompts(6), (PARAMS + WITH_PENALTIES)[:6])
    assert counts["forwards"] >= 10
    assert _copies(llm) - before == counts["forwards"]
    assert llm.engine.runner.sampler._staging is None, "the sampler sent a copy of its own"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["plain", "async"])
def test_graph_path_gives_the_eager_tokens(monkeypatch, async_scheduling):
    """Decode batches of every size up to 16 (requests end at different lengths), through
    the graph path: block tables sent as their span and sent dense, padding rows, the sampler
    on the graph's logits, tokens gathered on the device for a look-ahead step."""
    prompts = _prompts(16)
    params = [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]  # 16, 12, then 8 rows
    expected = _llm(block_size=4).generate(prompts, params)
    llm = _llm(block_size=4, async_scheduling=async_scheduling)
    graphs = _with_cpu_graphs(monkeypatch, llm)
    dense, put_rows = [], Upload.put_rows

    def spy(self, name, rows, width):
        before = len(self._scatters)
        put_rows(self, name, rows, width)
        dense.append(len(self._scatters) > before)

    monkeypatch.setattr(Upload, "put_rows", spy)
    replays = [0]
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda *a: (replays.__setitem__(0, replays[0] + 1),
                                                      replay(*a))[1])  # fmt: skip
    got = llm.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    flat = lambda cs: [lp for c in cs for lp in c.logprobs]
    assert flat(got) == pytest.approx(flat(expected), abs=1e-4)
    assert replays[0] >= 10 and set(dense) == {True, False}
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
