"""Gated MLP activations over a fused gate/up projection (Triton): SwiGLU's ``silu(gate) * up``
and Gemma's ``gelu_tanh(gate) * up``, one kernel with the activation as a constexpr.

Rounded as torch rounds ``F.silu(gate) * up`` and ``F.gelu(gate, approximate="tanh") * up``:
the activation in float32, rounded to the activations' dtype, then the product rounded again.
GELU is computed in torch's own form, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, so
it also loses what torch loses where ``tanh`` is near -1 (``1 + tanh`` is then a multiple of
2^-24): on CUDA with libdevice's ``tanhf``, the function torch's CUDA kernel calls; in the
interpreter (no libdevice) with ``tanh(u) = sign(u) (1 - e) / (1 + e)``, ``e = exp(-2|u|)``,
within a float32 ulp or two of it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.common import pdl_enter, pdl_kwargs

_BLOCK = 1024  # columns per program
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # torch: M_SQRT2 * M_2_SQRTPI * 0.5


@triton.jit
def gate_act(g, GELU_TANH: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``gelu_tanh(g)`` (GELU_TANH) or ``silu(g)`` of float32 ``g``, in float32, torch's forms;
    LIBDEVICE: libdevice's tanh (CUDA), else one made of exp (the interpreter). Also the
    epilogue of ``kernels.gemv``'s gated GEMV."""
    if GELU_TANH:
        u = _SQRT_2_OVER_PI * (g + 0.044715 * (g * g * g))
        if LIBDEVICE:
            th = libdevice.tanh(u)
        else:  # (1 - e) / (1 + e), e = exp(-2|u|): tanh's quantum near -1, as tanhf's
            e = tl.exp(-2.0 * tl.abs(u))
            th = (1.0 - e) / (1.0 + e)
            th = tl.where(u < 0, -th, th)
        return 0.5 * g * (1.0 + th)
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _act_and_mul_kernel(
    X,  # [T, 2I]
    Out,  # [T, I]
    stride_x,
    stride_o,
    inter,  # I
    GELU_TANH: tl.constexpr,  # else SiLU
    LIBDEVICE: tl.constexpr,  # libdevice's tanh (CUDA), else one made of exp (the interpreter)
    BLOCK: tl.constexpr,
    CHAIN: tl.constexpr,
):
    pdl_enter(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + offs, mask=mask, other=0.0)
    act = gate_act(gate.to(tl.float32), GELU_TANH, LIBDEVICE)
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up.to(tl.float32)).to(Out.dtype.element_ty),
             mask=mask)  # fmt: skip


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool, chain: bool) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I] with contiguous rows; got {tuple(x.shape)}")
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t:
        grid = (t, triton.cdiv(inter, _BLOCK))
        _act_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter,
                                  GELU_TANH=gelu_tanh, LIBDEVICE=x.device.type == "cuda",
                                  BLOCK=_BLOCK,
                                  **pdl_kwargs(x.device, chain))  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor, *, chain: bool = True) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``kernels.reference.silu_and_mul`` in one kernel; ``chain``: join the decode layer's PDL
    chain where the device supports it (``kernels.common.pdl_chain``)."""
    return _act_and_mul(x, False, chain)


def gelu_tanh_and_mul(x: torch.Tensor, *, chain: bool = True) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``kernels.reference.gelu_tanh_and_mul`` in one kernel; ``chain``: join the decode
    layer's PDL chain where the device supports it (``kernels.common.pdl_chain``)."""
    return _act_and_mul(x, True, chain)
