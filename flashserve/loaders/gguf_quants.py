"""GGUF's block quantizations dequantized by torch, on the device the weights go to.

``gguf.quants.dequantize`` runs numpy on one core: 100-330 M weights a second, 24-80 s for an
8B model's weights (``docs/benchmarks/load.md``). Here the packed bytes (4.5-8.5 bits a weight)
go to the device and are unpacked there (an H200: 0.4-1.9 s for 8B weights), with the same
float32 operations in the same order as llama.cpp's ``dequantize_row_*``
(``tests/test_gguf_quants.py`` holds every type to the ``gguf`` package's values, bit for
bit). Types not here (the IQ*, TQ*, MXFP4 families) go through the ``gguf`` package on the CPU
(``dequantize`` returns None for them).

Each function takes ``b``, uint8 ``[blocks, bytes a block]``, and returns float32 ``[blocks,
weights a block]``. The formats are llama.cpp's ``block_*`` structs (``ggml-common.h``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block, as float32 ``[blocks, 1]``."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor) -> torch.Tensor:
    """Each byte's 8 bits, least significant first: ``[blocks, 8 * bytes]`` uint8 0/1."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).flatten(1)


def _bit_planes(b: torch.Tensor) -> torch.Tensor:
    """Bit p of byte l at ``p * bytes + l``: ``[blocks, bytes]`` -> ``[blocks, 8 * bytes]``
    uint8 0/1 (the k-quants' high bits: bit p of byte l belongs to the p-th run of weights)."""
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).view(1, 8, 1)
    return ((b.unsqueeze(1) >> shifts) & 1).flatten(1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 32-weight nibble layout: the low nibbles of 16 bytes are weights 0-15, their high
    nibbles 16-31. ``qs`` ``[..., 16]`` -> ``[..., 32]``."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d, 16 bytes of nibbles; (q - 8) * d
    return (_nibbles(b[:, 2:18]).float() - 8) * _f16(b, 0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m, nibbles; q * d + m
    return _nibbles(b[:, 4:20]).float() * _f16(b, 0) + _f16(b, 2)


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0/Q5_1's 5-bit weights: the nibbles at ``at + 4`` with bit j of the 32-bit word at
    ``at`` as weight j's fifth bit."""
    high = _bits(b[:, at : at + 4]) << 4
    return _nibbles(b[:, at + 4 : at + 20]) | high


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # d, qh, nibbles; (q - 16) * d
    return (_q5(b, 2).float() - 16) * _f16(b, 0)


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # d, m, qh, nibbles; q * d + m
    return _q5(b, 4).float() * _f16(b, 0) + _f16(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d, 32 int8; q * d
    return b[:, 2:34].contiguous().view(torch.int8).float() * _f16(b, 0)


# ---- k-quants: 256-weight super-blocks of 16 or 8 sub-blocks with their own scales ----------


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K/Q3_K's 2-bit layout: 32-byte groups, each byte's bits 2j..2j+1 the weight j*32 +
    (its place in the group) of the group's 128. ``qs`` ``[blocks, 64]`` -> ``[blocks, 256]``."""
    shifts = torch.arange(0, 8, 2, device=qs.device, dtype=torch.uint8)
    groups = qs.view(-1, 2, 1, 32)  # [blocks, 128-weight half, shift, byte]
    return ((groups >> shifts.view(1, 1, 4, 1)) & 3).flatten(1)


def _per_sub_block(
    values: torch.Tensor, factor: torch.Tensor, offset: torch.Tensor | None = None
) -> torch.Tensor:
    """``values`` ``[blocks, 256]`` times ``factor`` ``[blocks, subs]``, each sub-block's, less
    ``offset`` ``[blocks, subs]``, each sub-block's, where given."""
    subs = factor.shape[1]
    out = values.view(-1, subs, 256 // subs) * factor.unsqueeze(-1)
    return (out if offset is None else out - offset.unsqueeze(-1)).flatten(1)


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    """16 bytes of scales (low nibble) and mins (high nibble), 64 bytes of 2-bit weights, d,
    dmin: ``d * scale * q - dmin * min`` over each 16 weights."""
    scales, d, dmin = b[:, :16], _f16(b, 80), _f16(b, 82)
    q = _crumbs(b[:, 16:80]).float()
    return _per_sub_block(q, d * (scales & 0xF).float(), dmin * (scales >> 4).float())


def _q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """Q3_K's 16 six-bit scales packed in 12 bytes: scale i's low 4 bits are byte i % 8's
    nibble i // 8, its top 2 bits byte 8 + i % 4's bits 2 * (i // 4); stored plus 32."""
    i = torch.arange(16, device=s.device)
    low = (s[:, i % 8] >> (4 * (i // 8)).to(torch.uint8)) & 0xF
    high = (s[:, 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    return (low | (high << 4)).float() - 32


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    """32 bytes of high bits, 64 of 2-bit weights, 12 of scales, d: each weight is its 2 bits
    minus 4 where its high bit is clear, times d * its 16 weights' scale. The high bit of weight
    n * 128 + j * 32 + l is bit 4n + j of byte l."""
    hbits = _bit_planes(b[:, :32])
    q = _crumbs(b[:, 32:96]).to(torch.int8) - ((hbits ^ 1) << 2).to(torch.int8)
    q = q.float()
    return _per_sub_block(q, _f16(b, 108) * _q3_k_scales(b[:, 96:108]))


def _k4_scales_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 8 six-bit scales and 8 mins packed in 12 bytes: sub-blocks 0-3 in the low 6
    bits of bytes 0-3 (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11 (scale low,
    min high) with their top 2 bits in bits 6-7 of bytes 0-3 (scales) and 4-7 (mins)."""
    first_scales, first_mins = s[:, 0:4] & 63, s[:, 4:8] & 63
    last_scales = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    last_mins = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    scales = torch.cat([first_scales, last_scales], dim=1).float()
    mins = torch.cat([first_mins, last_mins], dim=1).float()
    return scales, mins


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's layout: 32-byte groups, each giving 64 weights (low nibbles, then high).
    ``[blocks, 128]`` -> ``[blocks, 256]``."""
    groups = qs.view(-1, 4, 32)
    return torch.stack([groups & 0xF, groups >> 4], dim=2).flatten(1)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``d * scale * q - dmin * min`` over each 32 weights (Q4_K, Q5_K: d, dmin, then the
    12 bytes of scales and mins)."""
    scales, mins = _k4_scales_mins(b[:, 4:16])
    return _per_sub_block(q.float(), _f16(b, 0) * scales, _f16(b, 2) * mins)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # d, dmin, 12 bytes of scales, 128 of nibbles
    return _k_affine(b, _k_nibbles(b[:, 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K's layout with 32 bytes of fifth bits before the nibbles: weight g * 64 + h * 32 +
    l (group g, low/high nibble h) takes bit 2g + h of byte l."""
    high = _bit_planes(b[:, 16:48])
    return _k_affine(b, _k_nibbles(b[:, 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales, d: each weight is its
    6 bits minus 32, times d * its 16 weights' scale. In each 128-weight half, weight j * 32 + l
    takes nibble j // 2 of low byte (j % 2) * 32 + l and bits 2j..2j+1 of high byte l."""
    low = b[:, :128].view(-1, 2, 2, 32)  # [blocks, half, byte group, l]
    low = torch.stack([low & 0xF, low >> 4], dim=2).view(-1, 2, 4, 32)  # j = nibble * 2 + group
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = (b[:, 128:192].view(-1, 2, 1, 32) >> shifts) & 3
    q = (low | (high << 4)).flatten(1).float() - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    return _per_sub_block(q, _f16(b, 208) * scales)


_BLOCKS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k,
    Q.Q3_K: _q3_k,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
}
_FLOATS = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}
TYPES = frozenset(_BLOCKS) | frozenset(_FLOATS)  # what ``dequantize`` takes


def dequantize(raw: torch.Tensor, qtype: Q, chunk_blocks: int = 1 << 15) -> torch.Tensor | None:
    """``raw``: a tensor's bytes, uint8 ``[rows, bytes a row]``, on any device. Returns float32
    ``[rows, weights a row]`` on that device (a new tensor), or None for a type not in
    ``TYPES``. Blocks are unpacked ``chunk_blocks`` at a time: the temporaries stay a few times
    a chunk's float32 size (a 128K-row embedding's would be several GB at once)."""
    rows = raw.shape[0]
    if qtype in _FLOATS:
        return raw.contiguous().view(_FLOATS[qtype]).to(torch.float32, copy=True).view(rows, -1)
    if qtype not in _BLOCKS:
        return None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, block_bytes)
    out = torch.empty(blocks.shape[0], block, dtype=torch.float32, device=raw.device)
    for start in range(0, blocks.shape[0], chunk_blocks):
        out[start : start + chunk_blocks] = _BLOCKS[qtype](blocks[start : start + chunk_blocks])
    return out.view(rows, -1)
