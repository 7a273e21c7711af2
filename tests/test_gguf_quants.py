"""GGUF's block quantizations dequantized by torch (``flashserve.loaders.gguf_quants``) against
the ``gguf`` package's numpy, bit for bit, on random bytes: every scale and every packed weight
is a random bit pattern, extreme float16 scales included."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from flashserve.loaders.gguf_quants import TYPES, dequantize

Q = gguf.GGMLQuantizationType
TYPE_NAMES = sorted(t.name for t in TYPES)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _random_bytes(qtype: Q, rows: int, blocks_a_row: int) -> np.ndarray:
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return np.random.randint(0, 256, (rows, blocks_a_row * block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TYPE_NAMES)
def test_dequantize_equals_the_gguf_package(name, device):
    qtype = Q[name]
    # 16 blocks or more: a block's float16 scale is inf or NaN 1 time in 16 at most, so more
    # than half of them so is all but impossible (the last assertion)
    rows, blocks_a_row = np.random.randint(4, 9), np.random.randint(4, 7)
    raw = _random_bytes(qtype, rows, blocks_a_row)
    with np.errstate(all="ignore"):  # random float16 scales: inf and NaN among them
        want = torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype)))
    got = dequantize(torch.from_numpy(raw).to(device), qtype)
    assert got.dtype == torch.float32 and got.device.type == device
    assert got.shape == want.shape == (rows, blocks_a_row * gguf.GGML_QUANT_SIZES[qtype][0])
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(want).float().mean() > 0.5  # most of it compared as numbers


def test_dequantize_leaves_its_input_alone_and_returns_a_new_tensor():
    raw = torch.from_numpy(_random_bytes(Q.F32, 3, 4))
    before = raw.clone()
    out = dequantize(raw, Q.F32)
    out += 1
    assert torch.equal(raw, before)


def test_types_it_does_not_take_are_left_to_the_gguf_package():
    assert Q.IQ4_NL not in TYPES
    assert dequantize(torch.from_numpy(_random_bytes(Q.IQ4_NL, 2, 1)), Q.IQ4_NL) is None
    assert {Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.F16, Q.BF16} <= TYPES


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0"])
def test_chunks_of_blocks_give_the_whole_tensors_values(name):
    qtype = Q[name]
    raw = torch.from_numpy(_random_bytes(qtype, 5, 3))
    whole = dequantize(raw, qtype)
    torch.testing.assert_close(dequantize(raw, qtype, chunk_blocks=4), whole, rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip
