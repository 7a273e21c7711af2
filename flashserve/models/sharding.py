"""Tensor parallelism's sharding rules (Megatron style), in one place: which slice of each
tensor a rank holds, and the shape of its share of the model.

A tensor of the model is one of:

- **column-parallel** (``q/k/v_proj``, ``gate/up_proj`` and their fused forms ``qkv_proj``,
  ``gate_up_proj``): each rank holds rows of the output dimension, biases with their rows.
  Query heads split evenly; KV heads split evenly too, or, when there are fewer KV heads than
  ranks, each rank holds the one KV head its query heads read (replicated on ``N / Hkv``
  ranks). A fused tensor is cut part by part, the rank's pieces concatenated;
- **row-parallel** (``o_proj``, ``down_proj``): each rank holds columns of the input
  dimension, the same ranges as the column-parallel layer before it; the outputs of the ranks
  are summed (all-reduce; with ``TPComm.fold_for`` in the layer's GEMV and the norm after it).
  A bias is added once: rank 0 holds it, the others zeros;
- **vocabulary-parallel** (``lm_head``): each rank holds ``ceil(V / N)`` rows, the last
  rank's padded with zeros; the logits are gathered and the padding dropped. A tied head is
  the same rows of the (replicated) embeddings;
- **replicated**: everything else (the embeddings, norms, q/k head norms). A lookup reads one
  row a token, so a whole table per rank costs memory, not time, where a vocabulary-parallel
  one costs a step an all-reduce and its masking kernels (``DecoderForCausalLM.embed``).

Float8 weight scales (``<linear>.weight_scale`` or ``weight_scale_inv``) follow their weight
(``tensor_shard``): one scale per output row (``[N]`` or ``[N, 1]``) is cut with a
column-parallel weight's rows and replicated for a row-parallel one; a 128x128 block scale
``[ceil(N/128), ceil(K/128)]`` is cut along the weight's split dimension in whole blocks
(the ranks' ranges must start on multiples of 128: ``check_block_scales`` refuses a size
that breaks that, before any worker starts); a tensor-wise scale is replicated. A float weight
quantized at load (``--quantization fp8``, dummy weights) gets the scales of the whole tensor's
rows or blocks on every rank: a per-channel row-parallel one is quantized whole, then cut.

The rules key on checkpoint names (Hugging Face's, after ``checkpoint_name``) and on our own
parameter names (the fused projections, as dummy weights are drawn): the same function
serves safetensors slices, GGUF tensors and dummy weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from flashserve.models.config import ModelConfig

if TYPE_CHECKING:
    from kernels.fold import AllReduceFold

SCALE_BLOCK = 128  # rows and columns of one float8 block scale
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


class TPComm(Protocol):
    """The collectives of ``rank`` of ``size`` ranks: the model's two, then the runner's
    (``flashserve.engine.parallel.TPGroup`` implements them with torch.distributed)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place; returns ``x``."""

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on each rank -> ``[..., size * n]``, rank 0's columns first."""

    def fold_for(self, x: torch.Tensor) -> AllReduceFold | None:
        """The all-reduce folded into the row-parallel GEMV and the norm after it
        (``kernels.fold``) for a step whose activations look like ``x`` [T, hidden], where
        this step takes it; None: ``all_reduce`` after the layer."""

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x``, in place."""

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value``."""


class SingleRank:
    """The collectives of a model that is not sharded: nothing to do."""

    rank, size = 0, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def fold_for(self, x: torch.Tensor) -> None:
        return None

    def broadcast_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value


SINGLE = SingleRank()


@dataclass(frozen=True)
class Shard:
    """A rank's part of one tensor: along ``dim`` (None: all of it) the ``pieces``
    ``[start, stop)`` of a dimension of ``extent`` entries, concatenated, then ``pad`` zero
    entries (the vocabulary's padding); ``zeros``: a tensor of zeros of the whole shape (a
    row-parallel bias off rank 0, so that the sum over ranks adds it once)."""

    dim: int | None = None
    pieces: tuple[tuple[int, int], ...] = ()
    extent: int = 0
    pad: int = 0
    zeros: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The rank's shape of a tensor whose whole shape is ``full``."""
        if self.dim is None:
            return tuple(full)
        size = sum(b - a for a, b in self.pieces) + self.pad
        return tuple(size if d == self.dim else n for d, n in enumerate(full))

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of a whole tensor (GGUF tensors, dummy weights)."""
        return self.read(lambda index: full[index], tuple(full.shape), full.dtype, full.device)

    def read(self, get: Callable[[tuple[slice, ...]], torch.Tensor], full: tuple[int, ...],
             dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:  # fmt: skip
        """The rank's part through ``get(index)``, which reads ``tensor[index]`` (a
        safetensors slice reads only those bytes): each piece once."""
        if self.zeros:
            return torch.zeros(full, dtype=dtype, device=device)
        if self.dim is None:
            return get(tuple(slice(None) for _ in full))
        parts = [get(self._index(len(full), a, b)) for a, b in self.pieces]
        if self.pad:
            pad_shape = tuple(self.pad if d == self.dim else n for d, n in enumerate(full))
            parts.append(torch.zeros(pad_shape, dtype=dtype, device=device))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def _index(self, ndim: int, start: int, stop: int) -> tuple[slice, ...]:
        return tuple(slice(start, stop) if d == self.dim else slice(None) for d in range(ndim))


WHOLE = Shard()


@dataclass(frozen=True)
class RankShape:
    """What rank ``rank`` of ``size`` holds of a model, in heads, rows and columns."""

    config: ModelConfig
    rank: int
    size: int

    @property
    def heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        """The KV head of the rank's first query head (query heads ``g`` at a time share one,
        ``g = Hq / Hkv``): with fewer KV heads than ranks, the one it holds."""
        c = self.config
        group = c.num_attention_heads // c.num_key_value_heads
        return self.rank * self.heads // group

    @property
    def vocab_rows(self) -> int:
        """Rows of the LM head on each rank: ``ceil(V / N)``."""
        return -(-self.config.vocab_size // self.size)

    def vocab_range(self) -> tuple[int, int]:
        """The vocabulary ids whose logits this rank computes (the last rank's may be fewer
        than ``vocab_rows``, or none)."""
        start = min(self.rank * self.vocab_rows, self.config.vocab_size)
        return start, min(start + self.vocab_rows, self.config.vocab_size)

    def q_rows(self) -> tuple[int, int]:
        d = self.config.head_dim
        return self.rank * self.heads * d, (self.rank + 1) * self.heads * d

    def kv_rows(self) -> tuple[int, int]:
        d = self.config.head_dim
        return self.first_kv_head * d, (self.first_kv_head + self.kv_heads) * d

    def mlp_rows(self) -> tuple[int, int]:
        inter = self.config.intermediate_size // self.size
        return self.rank * inter, (self.rank + 1) * inter


def check_shardable(config: ModelConfig, size: int) -> None:
    """ValueError, in one line, unless the model splits over ``size`` ranks: query heads,
    KV heads (a multiple of ``size``, or a divisor of it: replicated) and the MLP's width.
    The vocabulary needs nothing (padded)."""
    if size == 1:
        return
    c, problems = config, []
    if c.num_attention_heads % size:
        problems.append(f"its {c.num_attention_heads} attention heads")
    kv = c.num_key_value_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} KV heads (neither a multiple nor a divisor of {size})")
    if c.intermediate_size % size:
        problems.append(f"its MLP width {c.intermediate_size}")
    if problems:
        raise ValueError(f"tensor-parallel size {size} does not divide {' nor '.join(problems)}")


def check_block_scales(config: ModelConfig, size: int) -> None:
    """ValueError, in one line, unless 128x128 float8 block scales split over ``size`` ranks
    in whole blocks: each rank's q rows, k/v rows and gate/up rows (the row-parallel layers'
    columns are the same ranges) must be multiples of 128, so that every rank's range of a
    weight starts on a block and each part of its fused projections (q/k/v into qkv_proj,
    gate/up into gate_up_proj) fills whole blocks, as one rank's do (``Linear.check_fusable``)."""
    if size == 1:
        return
    check_shardable(config, size)
    r = RankShape(config, 0, size)
    d = config.head_dim
    parts = {"q_proj": r.heads * d, "k_proj/v_proj": r.kv_heads * d,
             "gate_proj/up_proj": config.intermediate_size // size}  # fmt: skip
    bad = [f"{name} {rows}" for name, rows in parts.items() if rows % SCALE_BLOCK]
    if bad:
        raise ValueError(f"tensor-parallel size {size} would split 128x128 block-scaled fp8 "
                         f"weights inside their blocks: each rank's rows ({', '.join(bad)}) "
                         f"must be multiples of {SCALE_BLOCK}")  # fmt: skip


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's share of the model: its query and KV heads, its MLP width
    (``config`` itself when ``size`` is 1; the vocabulary is whole: the embeddings are
    replicated, the LM head's rows are ``RankShape.vocab_rows``)."""
    if size == 1:
        return config
    check_shardable(config, size)
    shape = RankShape(config, 0, size)
    return dataclasses.replace(
        config,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=config.intermediate_size // size,
    )


def tensor_shard(name: str, config: ModelConfig, rank: int, size: int,
                 shape: tuple[int, ...] | None = None) -> Shard:  # fmt: skip
    """The part of tensor ``name`` (a checkpoint name or one of our parameters) that rank
    ``rank`` of ``size`` holds. ``shape``: the tensor's whole shape, needed for a float8
    weight scale (which part of its weight's split it follows)."""
    if size == 1:
        return WHOLE
    if name.endswith(_SCALE_SUFFIXES):
        weight = name.removesuffix(".weight_scale_inv").removesuffix(".weight_scale")
        return _scale_shard(tensor_shard(f"{weight}.weight", config, rank, size), shape)
    r = RankShape(config, rank, size)
    c = config
    parts = name.split(".")
    if len(parts) < 2:
        return WHOLE
    module, kind = parts[-2], parts[-1]
    if module == "lm_head":
        start, stop = r.vocab_range()
        pieces = ((start, stop),) if stop > start else ()
        return Shard(0, pieces, c.vocab_size, pad=r.vocab_rows - max(0, stop - start))
    q, kv, mlp = r.q_rows(), r.kv_rows(), r.mlp_rows()
    column = {
        "q_proj": ((q,), c.q_size),
        "k_proj": ((kv,), c.kv_size),
        "v_proj": ((kv,), c.kv_size),
        "qkv_proj": ((q, _shift(kv, c.q_size), _shift(kv, c.q_size + c.kv_size)),
                     c.q_size + 2 * c.kv_size),
        "gate_proj": ((mlp,), c.intermediate_size),
        "up_proj": ((mlp,), c.intermediate_size),
        "gate_up_proj": ((mlp, _shift(mlp, c.intermediate_size)), 2 * c.intermediate_size),
    }  # fmt: skip
    row = {"o_proj": ((q,), c.q_size), "down_proj": ((mlp,), c.intermediate_size)}
    if module in column:
        pieces, extent = column[module]
        return Shard(0, pieces, extent)
    if module in row:
        if kind == "bias":  # added once, after the sum: rank 0's
            return WHOLE if rank == 0 else Shard(zeros=True)
        pieces, extent = row[module]
        return Shard(1, pieces, extent)
    return WHOLE


def _shift(rows: tuple[int, int], by: int) -> tuple[int, int]:
    return rows[0] + by, rows[1] + by


def _scale_shard(weight: Shard, shape: tuple[int, ...] | None) -> Shard:
    """A float8 weight scale's part: its weight's, along the same dimension, at the weight's
    resolution (one per row) or in 128-wide blocks; whole when the scale lacks that dimension
    (per-row scales of a row-parallel weight, a tensor-wise scale)."""
    if weight.dim is None or weight.zeros:
        return weight
    if shape is None:
        raise ValueError("a weight scale's shard needs its shape")
    if weight.dim >= len(shape) or shape[weight.dim] == 1:
        return WHOLE
    n = shape[weight.dim]
    if n == weight.extent:
        return weight
    blocks = -(-weight.extent // SCALE_BLOCK)
    if n != blocks:
        raise ValueError(f"a weight scale of shape {tuple(shape)} matches neither the rows nor "
                         f"the {SCALE_BLOCK}-blocks of its weight's {weight.extent}")  # fmt: skip
    pieces = []
    for a, b in weight.pieces:
        if a % SCALE_BLOCK or (b % SCALE_BLOCK and b != weight.extent):
            raise ValueError(f"{SCALE_BLOCK}x{SCALE_BLOCK} block scales cannot split at "
                             f"{a}..{b}: a rank's range must be whole blocks")  # fmt: skip
        pieces.append((a // SCALE_BLOCK, -(-b // SCALE_BLOCK)))
    return Shard(weight.dim, tuple(pieces), blocks)
