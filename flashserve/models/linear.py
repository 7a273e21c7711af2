"""The decoder's projections: one ``Linear`` for every one of them, unquantized or float8.

A ``Linear`` holds ``weight [N, K]`` in the model's dtype, or in float8 e4m3 with float32
``weight_scale`` (``kernels.quant``): one per output row (``[N]``), or one per 128x128 block
(``[cdiv(N, 128), cdiv(K, 128)]``); and an optional ``bias [N]`` in the model's dtype. Its
forward is the backend's one ``linear`` op, which takes the scale.

Weights arrive one checkpoint tensor at a time (``load``), into a row range of a fused
projection (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``):

- a float8 tensor is copied as it is; its scale, another tensor, fills the same rows of
  ``weight_scale``: a tensor-wise scale (one value) every row of its part, so the parts of a
  fused projection keep their own scales; block scales their block rows, which is why a part
  must start on a multiple of 128 rows (``check_fusable``);
- a float tensor meant for a float8 projection (``--quantization fp8``, or a layer an fp8
  checkpoint left unquantized) is quantized there, on the model's device, one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels.quant import E4M3, FP8_BLOCK, quantize_blocks, quantize_per_channel

CHANNEL, BLOCK = "channel", "block"


@dataclass(frozen=True)
class Fp8Weights:
    """How the projections hold float8 weights, and where their scales come from.

    scales: ``channel`` (one per output row) or ``block`` (128x128).
    checkpoint_scale: the suffix of the checkpoint's scale tensors, beside each ``weight``
      (``weight_scale``, ``weight_scale_inv``); None: the checkpoint is not quantized and
      every projection is quantized as it loads.
    source: what the checkpoint is, for the start-up log.
    """

    scales: str
    checkpoint_scale: str | None
    source: str

    def __post_init__(self) -> None:
        if self.scales not in (CHANNEL, BLOCK):
            raise ValueError(f"Fp8Weights.scales must be {CHANNEL} or {BLOCK}, not {self.scales}")


# bf16/fp16 checkpoints (and dummy weights) under --quantization fp8
QUANTIZE_AT_LOAD = Fp8Weights(CHANNEL, None, "quantized at load")


class Linear(nn.Module):
    """``x @ W.T + b`` through the backend's ``linear``; ``fp8``: the weight is float8 e4m3
    with ``weight_scale`` of that layout (None: the model's dtype, no scale)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend,
                 fp8: str | None = None):  # fmt: skip
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.ops = backend
        self.fp8 = fp8
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.weight_scale = None
        if fp8 is not None:
            self.weight_scale = nn.Parameter(torch.empty(self._scale_shape()))

    def _scale_shape(self) -> tuple[int, ...]:
        if self.fp8 == CHANNEL:
            return (self.out_features,)
        if self.fp8 == BLOCK:
            return (-(-self.out_features // FP8_BLOCK), -(-self.in_features // FP8_BLOCK))
        raise ValueError(f"fp8 must be None, {CHANNEL} or {BLOCK}, not {self.fp8!r}")

    def forward(self, x: torch.Tensor, fold=None, norm=None) -> torch.Tensor:  # [T, K] -> [T, N]
        """``fold`` (a row-parallel layer's folded all-reduce, ``kernels.fold``): the backend
        sends the output to the other rank too; ``norm`` (``kernels.reference.RowNorm``): of x
        RMSNormed by the backend as it reads it. Each passed only when set."""
        kwargs = {"fold": fold} if fold is not None else {}
        if norm is not None:
            kwargs["norm"] = norm
        return self.ops.linear(x, self.weight, self.bias, self.weight_scale, **kwargs)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``residual + self(x)`` and the partial sums of squares of its rows [T, P] (float32),
        which the next norm reads (the backend's ``linear_add``)."""
        return self.ops.linear_add(x, self.weight, self.bias, self.weight_scale, residual)

    def extra_repr(self) -> str:
        fp8 = f", fp8={self.fp8}" if self.fp8 else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{fp8}"

    def set_fp8_dtypes(self) -> None:
        """After ``Module.to(dtype)`` cast every parameter (on the meta device, before
        allocation): the weight back to float8 e4m3, the scales to float32."""
        if self.fp8 is None:
            return
        self.weight = nn.Parameter(self.weight.to(E4M3), requires_grad=False)
        self.weight_scale = nn.Parameter(self.weight_scale.float(), requires_grad=False)

    def check_fusable(self, parts: dict[str, int]) -> None:
        """ValueError unless block scales can hold these parts (name: rows, in row order)
        fused: each part but the last must span whole 128-row blocks."""
        if self.fp8 != BLOCK:
            return
        for name, rows in list(parts.items())[:-1]:
            if rows % FP8_BLOCK:
                raise ValueError(f"block-wise fp8 weights (128x128 scales) need {name}'s rows "
                                 f"in whole blocks of 128 to fuse {' + '.join(parts)} into one "
                                 f"projection; it has {rows}")  # fmt: skip

    # ---- loading ----------------------------------------------------------------------------

    @torch.no_grad()
    def load(self, kind: str, tensor: torch.Tensor, start: int, size: int | None, name: str,
             columns: Callable[[torch.Tensor], torch.Tensor] | None = None) -> bool:  # fmt: skip
        """Copy a checkpoint tensor into rows ``[start, start + size)`` (None: all rows):
        ``kind`` is ``weight``, ``bias`` or ``scale``. True when a float tensor was quantized
        here, filling these rows' scales too. ValueError naming ``name`` on a bad shape.

        ``columns`` (a per-channel float weight, whole, of a tensor-parallel rank's
        row-parallel projection): quantized whole, so that each row's scale is the whole
        row's, then cut by ``columns`` to the columns this projection holds."""
        size = self.out_features if size is None else size
        if kind == "bias":
            _copy(self.bias.data.narrow(0, start, size), tensor, name)
            return False
        if kind == "scale":
            self._load_scale(tensor, start, size, name)
            return False
        rows = self.weight.data.narrow(0, start, size)
        is_fp8 = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        if is_fp8 and (self.fp8 is None or tensor.dtype != E4M3):
            what = "e4m3 float8 weights" if self.fp8 else "unquantized weights"
            raise ValueError(f"tensor {name} is {tensor.dtype}; the model takes {what}")
        if is_fp8 or self.fp8 is None:
            _copy(rows, tensor, name)
            return False
        if columns is not None and self.fp8 != CHANNEL:
            raise ValueError(f"tensor {name}: only per-channel scales quantize a whole tensor "
                             "to keep some of its columns")  # fmt: skip
        if columns is None and tuple(tensor.shape) != tuple(rows.shape):
            _copy(rows, tensor, name)  # raises, naming the shapes
        w = tensor.to(device=rows.device, dtype=torch.float32)
        quantize = quantize_per_channel if self.fp8 == CHANNEL else quantize_blocks
        q, scale = quantize(w)
        if columns is not None:
            q = columns(q)
        _copy(rows, q, name)
        self._scale_rows(start, size).copy_(scale)
        return True

    def _scale_rows(self, start: int, size: int) -> torch.Tensor:
        """The rows of ``weight_scale`` that hold weight rows ``[start, start + size)``."""
        if self.fp8 == CHANNEL:
            return self.weight_scale.data.narrow(0, start, size)
        first = start // FP8_BLOCK
        return self.weight_scale.data.narrow(0, first, -(-(start + size) // FP8_BLOCK) - first)

    def _load_scale(self, tensor: torch.Tensor, start: int, size: int, name: str) -> None:
        dst = self._scale_rows(start, size)
        if tensor.numel() == 1 and self.fp8 == CHANNEL:  # per tensor: each of its rows
            dst.copy_(tensor.reshape(1).expand(size))
        elif self.fp8 == CHANNEL and tuple(tensor.shape) in ((size,), (size, 1)):
            dst.copy_(tensor.reshape(size))
        elif self.fp8 == BLOCK and tuple(tensor.shape) == tuple(dst.shape):
            dst.copy_(tensor)
        else:
            want = f"one value, ({size},) or ({size}, 1)" if self.fp8 == CHANNEL else (
                f"{tuple(dst.shape)} (128x128 blocks)")  # fmt: skip
            raise ValueError(f"tensor {name}: checkpoint shape {tuple(tensor.shape)}, model "
                             f"expects {want}")  # fmt: skip


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"tensor {name}: checkpoint shape {tuple(src.shape)}, "
                         f"model expects {tuple(dst.shape)}")  # fmt: skip
    dst.copy_(src)
