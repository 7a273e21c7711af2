"""The KV pool's size: ``--max-kv-tokens``, ``--kv-cache-memory-bytes`` or free memory, and
the refusals when it cannot hold a block or asks for more than a GPU has. The GPU's free
memory is stood in for (``_cuda_kv_budget``); the whole engine runs in the CLI tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashserve.config import EngineConfig
from flashserve.engine.model_runner import ModelRunner


def _runner(device: str, room: int, **config) -> SimpleNamespace:
    """What ``_plan_num_blocks`` and ``_no_kv_block`` read of a runner; ``room``: the bytes a
    GPU has free after the weights and a step's activations (``_cuda_kv_budget(None)``)."""
    cfg = EngineConfig(device="cpu", **config)
    r = SimpleNamespace(config=cfg, device=torch.device(device), block_size=cfg.block_size,
                        kv_bytes_per_token=1000, num_blocks=0)  # fmt: skip
    r._cuda_kv_budget = lambda utilization: room if utilization is None else room // 2
    return r


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_pool_takes_the_bytes_asked_for(device):
    r = _runner(device, room=10**9, kv_cache_memory_bytes=16_000 * 7 + 5)
    assert ModelRunner._plan_num_blocks(r) == 7  # 16-token blocks of 16,000 bytes


def test_more_bytes_than_the_gpu_has_free_are_refused_on_every_rank():
    r = _runner("cuda", room=300_000, kv_cache_memory_bytes=300_001)
    assert ModelRunner._plan_num_blocks(r) == -1  # every rank's min is then -1: all refuse
    r.num_blocks = -1
    assert "300,001 is more than a GPU has free" in ModelRunner._no_kv_block(r)
    r = _runner("cuda", room=300_000, kv_cache_memory_bytes=300_000)
    assert ModelRunner._plan_num_blocks(r) == 18


def test_a_pool_without_a_block_names_what_to_change():
    r = _runner("cpu", room=0, kv_cache_memory_bytes=15_999)
    assert ModelRunner._plan_num_blocks(r) == 0
    assert ModelRunner._no_kv_block(r) == (
        "kv_cache_memory_bytes 15,999 holds no KV block: a block of 16 tokens takes 16,000 "
        "bytes here"
    )
    r = _runner("cuda", room=0)
    assert ModelRunner._plan_num_blocks(r) == 0  # utilization's share of nothing
    assert "raise --gpu-memory-utilization" in ModelRunner._no_kv_block(r)


def test_max_kv_tokens_comes_first_and_excludes_the_bytes():
    r = _runner("cuda", room=0, max_kv_tokens=64)
    assert ModelRunner._plan_num_blocks(r) == 4
    with pytest.raises(ValueError, match="max_kv_tokens or kv_cache_memory_bytes, not both"):
        EngineConfig(device="cpu", max_kv_tokens=64, kv_cache_memory_bytes=10**6)
