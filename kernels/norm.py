"""RMSNorm, alone, fused with the residual add before it, or (Gemma's sandwich) with the
sublayer output's own RMSNorm before that add too (Triton).

One program per token row. The rounding follows ``kernels.reference``: the residual sum is
rounded to the activations' dtype (it is the residual stream), the normalised row is computed
in float32 and rounded to that dtype, then multiplied by the weight and rounded again. Gemma's
norm (``unit_offset``) scales by ``1 + w`` in float32 instead and rounds once, to the
activations' dtype. The sandwich rounds the first norm's output where ``rms_norm`` would
return it, then adds and norms as above. Only the order of the float32 sum of squares differs
from torch, which moves a result by at most one unit in the last place of the output dtype.

Under tensor parallelism on two ranks (``FOLD``, ``fold=``) the input is this rank's partial sum
of a row-parallel layer: the kernel first waits for the other rank's (its GEMV stored them into
this rank's slot as words tagged with the call: ``kernels.fold``) and adds them in float32,
rounded to the input's dtype as an all-reduce returns the sum; the rest is unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common import pdl_enter, pdl_kwargs
from kernels.fold import AllReduceFold, fold_recv


@triton.jit
def _normed(x, w, eps, H: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """RMSNorm of the row ``x`` (its dtype is the one the normalised row rounds to) with the
    weight ``w`` (float32), float32, before the caller's rounding to the output dtype."""
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    if UNIT_OFFSET:
        return (xf * inv) * (1.0 + w)
    return w * (xf * inv).to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X,  # [T, H]
    Res,  # [T, H], the residual stream (HAS_RES)
    WPost,  # [H], X's own norm, applied before the residual add (POST_NORM)
    W,  # [H]
    Out,  # [T, H]
    ResOut,  # [T, H], Res + X, or Res + rms_norm(X, WPost) (HAS_RES)
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    H: tl.constexpr,
    HAS_RES: tl.constexpr,
    POST_NORM: tl.constexpr,  # Gemma's sandwich: norm X with WPost first (needs HAS_RES)
    POST_F32: tl.constexpr,  # that norm's output is float32 (torch promotes X with WPost)
    UNIT_OFFSET: tl.constexpr,  # Gemma: scale by 1 + w in float32, one rounding
    BLOCK: tl.constexpr,
    CHAIN: tl.constexpr,
    Recv=None,  # [2, R, H] int64 words, the peer's partial sums of X, slot k % 2 (FOLD:
    # kernels.fold)
    Calls=None,  # [1] int64, this rank's folded calls (FOLD)
    Status=None,  # [1] int64, the tag a program gave up on (FOLD)
    stride_recv=0,  # words of one slot of Recv (FOLD)
    spin_limit=0,  # reads of the row's words before giving up (FOLD)
    FOLD: tl.constexpr = False,  # X is this rank's partial sum: wait for the peer's, add it
):
    pdl_enter(CHAIN)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    # every load first, so that their round trips overlap (and, folded, the peer's words'
    # and the counter's: fold_recv)
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    r = x
    w_post = w
    if HAS_RES:
        r = tl.load(Res + row * stride_r + offs, mask=mask, other=0.0)
        if POST_NORM:
            w_post = tl.load(WPost + offs, mask=mask, other=0.0).to(tl.float32)
    if FOLD:  # the all-reduce: the two ranks' sums added in float32, rounded as NCCL rounds
        peer = fold_recv(Recv, stride_recv, row * H + offs, mask, Calls, Status, spin_limit,
                         X.dtype.element_ty)  # fmt: skip
        x = (x.to(tl.float32) + peer.to(tl.float32)).to(x.dtype)
    if HAS_RES:
        xf = x.to(tl.float32)
        if POST_NORM:  # rounded where the separate rms_norm rounds its output
            xf = _normed(x, w_post, eps, H, UNIT_OFFSET)
            if not POST_F32:
                xf = xf.to(x.dtype).to(tl.float32)
        x = (r.to(tl.float32) + xf).to(ResOut.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    y = _normed(x, w, eps, H, UNIT_OFFSET)
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def _launch(x, residual, post_weight, weight, eps, unit_offset, out, res_out, chain,
            fold=None) -> None:  # fmt: skip
    t, h = x.shape
    if t == 0:
        return
    block = triton.next_power_of_2(h)
    has_res = residual is not None
    post = post_weight is not None
    post_f32 = post and _out_dtype(x.dtype, post_weight, unit_offset) == torch.float32
    # Llama's first norm ends in ``w * normed``, which the compiler may contract with the
    # residual add into one FMA (LLVM, and ptxas's --fmad): one rounding where torch's two
    # kernels round twice. With a float32 result nothing is rounded between them; with a bf16
    # one the cast is no barrier either (Triton multiplies bf16 natively: the H100 run of
    # test_layer_kernels_at_model_shapes_in_bf16 saw the residual differ at the Qwen3 and
    # Phi-4-mini shapes). Off for those kernels only; Gemma's first norm ends in a cast of
    # ``normed * (1 + w)``, matched bit for bit with fusion on.
    fusion = {"enable_fp_fusion": False} if post and (post_f32 or not unit_offset) else {}
    _rms_norm_kernel[(t,)](
        x, residual if has_res else x, post_weight if post else weight, weight, out,
        res_out if has_res else out,
        x.stride(0), residual.stride(0) if has_res else 0, out.stride(0),
        res_out.stride(0) if has_res else 0, eps,
        H=h, HAS_RES=has_res, POST_NORM=post, POST_F32=post_f32, UNIT_OFFSET=unit_offset,
        BLOCK=block, num_warps=max(1, min(16, block // 512)),
        **fusion, **pdl_kwargs(x.device, chain), **_fold_args(fold),
    )  # fmt: skip


def _fold_args(fold: AllReduceFold | None) -> dict:
    """_rms_norm_kernel's FOLD arguments: this rank's slots, counter and status."""
    if fold is None:
        return dict(Recv=None, Calls=None, Status=None, stride_recv=0, spin_limit=0,
                    FOLD=False)  # fmt: skip
    return dict(Recv=fold.recv, Calls=fold.calls, Status=fold.status,
                stride_recv=fold.recv.stride(0), spin_limit=fold.spin_limit,
                FOLD=True)  # fmt: skip


def _out_dtype(x_dtype: torch.dtype, weight: torch.Tensor, unit_offset: bool) -> torch.dtype:
    """torch's: ``weight * normed`` promotes; Gemma's ``((1 + w) * normed_f32).to(x.dtype)``
    does not."""
    return x_dtype if unit_offset else torch.promote_types(x_dtype, weight.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")  # fmt: skip
    if x.stride(1) != 1:
        raise ValueError("the hidden dim of x must be contiguous")


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
    *,
    chain: bool = True,
) -> torch.Tensor:  # [T, H], in the dtype torch's version returns
    """``kernels.reference.rms_norm`` in one kernel (``unit_offset``: Gemma's ``(1 + w)``
    norm); ``chain``: join the decode layer's PDL chain where the device supports it
    (``kernels.common.pdl_chain``)."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=_out_dtype(x.dtype, weight, unit_offset), device=x.device)
    _launch(x, None, None, weight, eps, unit_offset, out, None, chain)
    return out


def add_rms_norm(
    x: torch.Tensor,  # [T, H], a sublayer's output
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    unit_offset: bool = False,
    *,
    chain: bool = True,
    fold: AllReduceFold | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(residual + x), residual + x
    """``kernels.reference.add_rms_norm`` in one kernel (``unit_offset``: Gemma's ``(1 + w)``
    norm); ``chain``: join the decode layer's PDL chain where the device supports it
    (``kernels.common.pdl_chain``). ``fold``: ``x`` is this rank's partial sum of a
    row-parallel layer whose GEMV sent the peer's its own (``kernels.fold``): the kernel waits
    for the peer's and adds it to ``x`` (rounded to x's dtype, as an all-reduce returns it)
    before the rest."""
    return _add_norm(x, residual, None, weight, eps, unit_offset, chain, fold)


def norm_add_norm(
    x: torch.Tensor,  # [T, H], a sublayer's output
    residual: torch.Tensor,  # [T, H]
    post_weight: torch.Tensor,  # [H], the sublayer's own output norm
    weight: torch.Tensor,  # [H], the next sublayer's input norm
    eps: float,
    unit_offset: bool = False,
    *,
    chain: bool = True,
    fold: AllReduceFold | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # rms_norm(residual + rms_norm(x)), that residual
    """``kernels.reference.norm_add_norm`` in one kernel: Gemma's two norms between
    sublayers (the output's own norm, the residual add, the next input norm), one launch
    where the separate calls take two; ``chain`` as ``add_rms_norm``'s. The normed output is
    rounded to the dtype torch's ``rms_norm`` returns before the add, as there. ``fold`` as
    ``add_rms_norm``'s: the output norm applies to the two ranks' sum (a norm is not linear:
    each rank's partial cannot be normed alone)."""
    _check(x, post_weight)
    if _out_dtype(x.dtype, post_weight, unit_offset) not in (x.dtype, torch.float32):
        raise ValueError(f"post_weight {post_weight.dtype} with x {x.dtype}: the normed "
                         "output must be in x's dtype or float32")  # fmt: skip
    return _add_norm(x, residual, post_weight, weight, eps, unit_offset, chain, fold)


def _add_norm(x, residual, post_weight, weight, eps, unit_offset, chain, fold=None):
    _check(x, weight)
    if residual.shape != x.shape or residual.stride(1) != 1:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    if fold is not None:
        fold.check(x, "the norm's input")
    h_dtype = x.dtype if post_weight is None else _out_dtype(x.dtype, post_weight, unit_offset)
    res_out = torch.empty(x.shape, dtype=torch.promote_types(h_dtype, residual.dtype),
                          device=x.device)  # fmt: skip
    out = torch.empty(x.shape, dtype=_out_dtype(res_out.dtype, weight, unit_offset),
                      device=x.device)  # fmt: skip
    _launch(x, residual, post_weight, weight, eps, unit_offset, out, res_out, chain, fold)
    return out, res_out
