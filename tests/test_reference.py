"""The torch reference attention over a paged cache equals SDPA on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import reference as ref


def _paged(k: torch.Tensor, block_size: int, extra_blocks: int = 3):
    """Scatter contiguous [S, H, D] into shuffled blocks of a pool; returns (pool, table)."""
    s = k.shape[0]
    nb = -(-s // block_size)
    perm = torch.randperm(nb + extra_blocks)[:nb]
    pool = torch.randn(nb + extra_blocks, block_size, *k.shape[1:], dtype=k.dtype)
    flat = pool.view(-1, *k.shape[1:])
    slots = perm.repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(nb)
    flat[slots[:s]] = k
    return pool, perm.to(torch.int32)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 37), (17, 17), (5, 40), (64, 100)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_prefill_matches_sdpa(q_len, kv_len, hq, hkv):
    d, bs = 16, 8
    q = torch.randn(q_len, hq, d, dtype=torch.float64)
    k = torch.randn(kv_len, hkv, d, dtype=torch.float64)
    v = torch.randn(kv_len, hkv, d, dtype=torch.float64)
    kp, table = _paged(k, bs)
    vp = torch.empty_like(kp)
    vp.view(-1, hkv, d)[(table.long()[:, None] * bs + torch.arange(bs)).flatten()[:kv_len]] = v
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    lens = torch.tensor([kv_len], dtype=torch.int32)
    out, lse = ref.prefill_attention(q, kp, vp, cu, lens, table[None], 0.3, return_lse=True)
    # SDPA with an explicit bottom-right causal mask
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    qe, ke, ve = (x.transpose(0, 1) for x in (q, k, v))
    ke = ke.repeat_interleave(hq // hkv, 0)
    ve = ve.repeat_interleave(hq // hkv, 0)
    expect = F.scaled_dot_product_attention(qe, ke, ve, attn_mask=mask, scale=0.3).transpose(0, 1)
    scores = (qe @ ke.transpose(1, 2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).transpose(0, 1))


def test_write_kv_skips_padding_slots():
    pool_k = torch.zeros(4, 4, 2, 8)
    pool_v = torch.zeros(4, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ref.write_kv(k, v, pool_k, pool_v, torch.tensor([5, -1, 14]))
    flat = pool_k.view(-1, 2, 8)
    torch.testing.assert_close(flat[5], k[0])
    torch.testing.assert_close(flat[14], k[2])
    assert flat.abs().sum(dim=(1, 2)).nonzero().flatten().tolist() == [5, 14]
    torch.testing.assert_close(pool_v.view(-1, 2, 8)[14], v[2])


def test_decode_equals_last_row_of_prefill():
    hq, hkv, d, bs, n = 6, 3, 16, 4, 23
    k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
    q = torch.randn(n, hq, d)
    kp, table = _paged(k, bs)
    vp = torch.empty_like(kp)
    vp.view(-1, hkv, d)[(table.long()[:, None] * bs + torch.arange(bs)).flatten()[:n]] = v
    lens = torch.tensor([n], dtype=torch.int32)
    full = ref.prefill_attention(q, kp, vp, torch.tensor([0, n], dtype=torch.int32), lens,
                                 table[None], 0.25)  # fmt: skip
    dec = ref.decode_attention(q[-1:], kp, vp, lens, table[None], 0.25)
    torch.testing.assert_close(dec[0], full[-1])
