"""SwiGLU's gate, ``silu(gate) * up`` over a fused gate/up projection (Triton).

Rounded as torch rounds ``F.silu(gate) * up``: the SiLU in float32, rounded to the activations'
dtype, then the product rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import pdl_enter, pdl_kwargs

_BLOCK = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    X,  # [T, 2I]
    Out,  # [T, I]
    stride_x,
    stride_o,
    inter,  # I
    BLOCK: tl.constexpr,
    CHAIN: tl.constexpr,
):
    pdl_enter(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (silu * up.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip


def silu_and_mul(x: torch.Tensor, *, chain: bool = True) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``kernels.reference.silu_and_mul`` in one kernel; ``chain``: join the decode layer's PDL
    chain where the device supports it (``kernels.common.pdl_chain``)."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with contiguous rows; got {tuple(x.shape)}")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t:
        grid = (t, triton.cdiv(inter, _BLOCK))
        _silu_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, BLOCK=_BLOCK,
                                   **pdl_kwargs(x.device, chain))  # fmt: skip
    return out
