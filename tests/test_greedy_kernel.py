"""kernels.sampling.greedy_sample against torch's argmax and log_softmax (Triton's interpreter on
CPU, the GPU when there is one)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not importable on this machine")

from kernels.sampling import greedy_sample  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("n", "vocab"), [(1, 100), (3, 4096), (2, 10000), (5, 128256)])
def test_greedy_sample_matches_torch(n, vocab):
    logits = torch.randn(n, vocab, device=DEVICE) * 5
    ids, lps = greedy_sample(logits)
    assert torch.equal(ids, logits.argmax(-1))
    # against float64: torch's own float32 log_softmax is ~1e-5 off at a 128K vocabulary
    ref = logits.double().log_softmax(-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), ref, rtol=1e-5, atol=1e-5)


def test_greedy_sample_ties_pick_the_first_index_across_chunks():
    logits = torch.full((2, 9000), -3.0, device=DEVICE)
    logits[0, [5000, 8000, 4100]] = 7.0  # ties in two chunks: the first index wins
    logits[1, [20, 4096]] = 2.0
    logits[1, 8999] = float("-inf")
    ids, lps = greedy_sample(logits)
    assert ids.tolist() == [4100, 20] == logits.argmax(-1).tolist()
    ref = logits.double().log_softmax(-1).gather(1, ids[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), ref, rtol=1e-5, atol=1e-5)


def test_greedy_sample_strided_rows_and_bad_input():
    logits = torch.randn(3, 6000, device=DEVICE)[:, :5000]
    ids, _ = greedy_sample(logits)
    assert torch.equal(ids, logits.argmax(-1))
    with pytest.raises(ValueError, match="float32"):
        greedy_sample(logits.half())
