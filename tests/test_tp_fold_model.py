"""The model's side of the folded all-reduce (``--tp-all-reduce fused``): which calls carry
``fold`` (``flashserve/models/decoder.py``). Two ranks of a tiny model run at once in two
threads of this process, on the torch backend's ops wrapped so that a linear given ``fold``
puts its output in a queue to the other rank and a norm given ``fold`` takes the other's
from its own queue and adds it first (the sum the kernels make, ``kernels.fold``; their
ordering is tests/test_tp_fold.py's). Every row-parallel output must then meet exactly one
norm, in order: the same hidden states, bit for bit, as the same ranks all-reducing after
each layer, for Llama's layer and Gemma's sandwich, with the final norm folded too (the
embeddings are replicated: no all-reduce).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import pytest
import torch
from model_utils import block_tables, make_kv_caches, step_metadata

from flashserve.models.attention import load_backend
from flashserve.models.config import ModelConfig
from flashserve.models.decoder import build_model, init_random
from flashserve.models.presets import PRESETS
from kernels import reference

GEMMA_TINY = {**PRESETS["gemma3-12b"], "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 16,
              "sliding_window": 8, "max_position_embeddings": 256}  # fmt: skip
CONFIGS = {"llama": PRESETS["tiny"], "gemma3": GEMMA_TINY}
TIMEOUT_S = 60.0


@dataclass
class QueueFold:
    """A stand-in for ``kernels.fold.AllReduceFold``: this rank's queue out and in."""

    send: queue.Queue
    recv: queue.Queue
    sent: int = 0
    received: int = 0


class ThreadPair:
    """The collectives of two ranks that are threads of one process (``TPComm``): the
    all-reduce sums in rank order, as gloo or NCCL does for two; ``fold_for`` hands out the
    rank's ``QueueFold`` when folding."""

    def __init__(self, fold: bool) -> None:
        self.barrier = threading.Barrier(2, timeout=TIMEOUT_S)
        self.slots: list[torch.Tensor | None] = [None, None]
        q = [queue.Queue(), queue.Queue()]
        self.folds = [QueueFold(q[1], q[0]), QueueFold(q[0], q[1])] if fold else None

    def comm(self, rank: int) -> RankComm:
        return RankComm(self, rank)


class RankComm:
    size = 2

    def __init__(self, pair: ThreadPair, rank: int) -> None:
        self.pair, self.rank = pair, rank
        self.all_reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        self.pair.slots[self.rank] = x.clone()
        self.pair.barrier.wait()
        total = (self.pair.slots[0].float() + self.pair.slots[1].float()).to(x.dtype)
        self.pair.barrier.wait()
        return x.copy_(total)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("not called: the test compares hidden states")

    def fold_for(self, x: torch.Tensor) -> QueueFold | None:
        return None if self.pair.folds is None else self.pair.folds[self.rank]

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value


def folding_backend():
    """The torch backend, its linear and add-norms taking ``fold`` as the Triton ones do."""
    backend = load_backend("torch")

    def linear(x, weight, bias=None, weight_scale=None, fold=None):
        y = reference.linear(x, weight, bias, weight_scale)
        if fold is not None:
            fold.send.put(y.clone())
            fold.sent += 1
        return y

    def summed(x, fold):
        if fold is None:
            return x
        fold.received += 1
        return (x.float() + fold.recv.get(timeout=TIMEOUT_S).float()).to(x.dtype)

    def add_rms_norm(x, residual, weight, eps, unit_offset=False, fold=None):
        return reference.add_rms_norm(summed(x, fold), residual, weight, eps, unit_offset)

    def norm_add_norm(x, residual, post, weight, eps, unit_offset=False, fold=None):
        return reference.norm_add_norm(summed(x, fold), residual, post, weight, eps,
                                       unit_offset)  # fmt: skip

    backend.linear, backend.add_rms_norm = linear, add_rms_norm
    backend.norm_add_norm = norm_add_norm
    return backend


def rank_steps(config: ModelConfig, comm: RankComm, prompt: list[int], decodes: int):
    """A prompt's prefill then ``decodes`` greedy-free decode steps (fixed next tokens) on
    this rank's share; the hidden states of every step."""
    model = build_model(config, folding_backend(), "cpu", torch.float32, tp=comm)
    init_random(model, seed=3)
    bs = 16
    table, blocks = block_tables([len(prompt) + decodes], bs, shuffle=False)
    caches = make_kv_caches(model, blocks, bs)
    out, tokens, start = [], list(prompt), 0
    for step in range(decodes + 1):
        ids = tokens[start:] if step == 0 else [tokens[-1]]
        meta = step_metadata([(start, len(ids))], table, bs, torch.device("cpu"))
        flat = torch.tensor(ids, dtype=torch.int64)
        positions = torch.arange(start, start + len(ids))
        with torch.no_grad():
            out.append(model(flat, positions, caches, meta).clone())
        start += len(ids)
        tokens.append((7 * step + 11) % config.vocab_size)
    return out


def run_pair(config: ModelConfig, fold: bool):
    pair = ThreadPair(fold)
    comms = [pair.comm(r) for r in range(2)]
    results: list = [None, None]

    def rank(r: int) -> None:
        try:
            results[r] = rank_steps(config, comms[r], [5, 9, 2, 44, 17, 3], 3)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[r] = exc
            pair.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    for r in range(2):
        if isinstance(results[r], BaseException):
            raise AssertionError(f"rank {r} failed") from results[r]
    return results, comms, pair


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_every_row_parallel_output_meets_one_norm(arch):
    config = ModelConfig.from_hf_dict(CONFIGS[arch], name=f"tiny-{arch}")
    layers = config.num_hidden_layers
    plain, plain_comms, _ = run_pair(config, fold=False)
    folded, folded_comms, pair = run_pair(config, fold=True)
    steps = len(plain[0])
    for r in range(2):
        for step in range(steps):
            assert torch.equal(folded[r][step], plain[r][step]), (arch, r, step)
        # each layer's two row-parallel outputs went through the queues, none left over;
        # nothing was all-reduced
        f = pair.folds[r]
        assert f.sent == f.received == 2 * layers * steps, (f.sent, f.received)
        assert f.recv.empty()
        assert folded_comms[r].all_reduces == 0
        assert plain_comms[r].all_reduces == 2 * layers * steps
    assert torch.equal(folded[0][-1], folded[1][-1])  # both ranks hold the same sums
