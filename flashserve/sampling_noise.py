"""Counter-based Exp(1) noise for seeded sampling, made of integer tensor ops.

The noise of (seed, step, vocab index) is a pure function of those three integers: the same on
CPU and CUDA (the integer hash is bit-exact; -log may differ by an ulp), whatever the batch.
All integer arithmetic stays in 32-bit lanes of int64 tensors with no signed overflow.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32_(x: torch.Tensor, c: int) -> torch.Tensor:
    """In place: x * c mod 2**32, for int64 x in [0, 2**32) and a 32-bit constant c.

    A c >= 2**31 is used as c - 2**32 (same residue, |c - 2**32| <= 2**31), so the product's
    magnitude stays below 2**63: no signed overflow, and the two's-complement mask gives the same
    bits on CPU and CUDA.
    """
    return x.mul_(c - 2**32 if c >> 31 else c).bitwise_and_(_M32)


def hash32_(x: torch.Tensor) -> torch.Tensor:
    """In place: lowbias32 (C. Wellons), a bijective 32-bit mixer. x: int64 in [0, 2**32)."""
    x.bitwise_xor_(x >> 16)
    _mul32_(x, 0x7FEB352D)
    x.bitwise_xor_(x >> 15)
    _mul32_(x, 0x846CA68B)
    return x.bitwise_xor_(x >> 16)


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[S] int64 seeds (63-bit) and steps -> [S] int64 32-bit keys.

    For a fixed seed, distinct steps (mod 2**32) give distinct keys: a stream never repeats.
    """
    key = hash32_(seed >> 32)
    key = hash32_(key.bitwise_xor_(seed & _M32))
    return hash32_(key.bitwise_xor_(step & _M32))


def exponential_noise(
    seed: torch.Tensor, step: torch.Tensor, vocab_hash: torch.Tensor
) -> torch.Tensor:
    """Exp(1) noise for each (row, vocab index): [S], [S], [V] -> [S, V] float32.

    vocab_hash is hash32 of arange(V).
    """
    bits = hash32_(vocab_hash.unsqueeze(0) ^ row_keys(seed, step).unsqueeze(1))  # [S, V]
    return exponential_from_bits_(bits)


def exponential_from_bits_(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64, consumed) -> Exp(1) float32 E = -log(u), always > 0 and finite.

    u = (top 23 bits + 0.5) / 2**23 is exact in float32 and lies in [2**-24, 1 - 2**-24]. With 24
    bits the top value would round to 1.0, E = 0, and p / E = inf would pick that token whatever
    its probability (1 row in 128 at V = 128K).
    """
    u = bits.bitwise_right_shift_(9).to(torch.float32).add_(0.5).mul_(2.0**-23)
    return u.log_().neg_()
