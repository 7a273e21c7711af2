"""A GGUF file's header (metadata and tensor infos), read and checked before any tensor data.

After the metadata (``gguf_metadata``) come the tensor infos: for each tensor a string name,
a u32 dimension count, that many u64 dimensions (ggml's ``ne``, innermost first), a u32 ggml
type and a u64 offset into the data. The data starts at the first multiple of the alignment
(``general.alignment``, 32 by default) after the infos, and holds the tensors back to back
in the order of their infos, each padded to a multiple of the alignment. A file cut short by
a failed download or copy, or overwritten, breaks one of these rules, or holds a type we
cannot dequantize: checking them here turns what ``gguf.GGUFReader`` would raise (numpy's
reshape and view errors, an IndexError) or miss until a weight is read into a
``WeightsError`` that says which file and what is wrong. It costs one pass over the header
(0.1 s for the default model's 49K-token vocabulary), whatever the file's size.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from flashserve.loaders.errors import WeightsError
from flashserve.loaders.gguf_metadata import Corrupt, Cursor, Overrun, read_prefix

GGML_MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # ggml's ne: innermost (contiguous) dimension first
    offset: int  # from the start of the data
    nbytes: int


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int  # where the data starts in the file


def read_header(file: Path) -> Header:
    """``file``'s metadata and tensor infos, once the header is whole and valid, every tensor
    is of a type we can dequantize and the data holds every tensor's bytes: WeightsError
    naming the file and the problem otherwise."""
    with file.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses empty files
            raise WeightsError(file, "truncated: 0 bytes, too short for a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            version, num_tensors, meta, pos = read_prefix(file, data)
            cursor = Cursor(data, pos)
            tensors = [_tensor_info(file, cursor, i, num_tensors) for i in range(num_tensors)]
            size = len(data)
    align = _alignment(file, meta)
    data_offset = -(-cursor.pos // align) * align
    _check_names(file, tensors)
    _check_extents(file, tensors, align, size - data_offset)
    for t in tensors:
        if not readable(t.type):
            raise WeightsError(file, f"tensor {t.name} is {t.type.name}: a type we cannot read "
                                     f"(readable: {', '.join(_readable_names())})")  # fmt: skip
    return Header(version, meta, tensors, data_offset)


def _tensor_info(file: Path, cursor: Cursor, i: int, n: int) -> TensorInfo:
    name = None
    try:
        name = cursor.string()
        dims = cursor.scalar("I")
        if dims > GGML_MAX_DIMS:
            raise Corrupt(f"{dims} dimensions (at most {GGML_MAX_DIMS})")
        shape = tuple(cursor.scalar("Q") for _ in range(dims))
        raw_type, offset = cursor.scalar("I"), cursor.scalar("Q")
    except Overrun:
        where = f"tensor {i + 1} of {n}" + (f", {name}" if name is not None else "")
        raise WeightsError(file, f"truncated: the file ends in its tensor infos ({where}) at "
                                 f"{len(cursor.data)} bytes") from None  # fmt: skip
    except Corrupt as exc:
        raise WeightsError(file, f"corrupt: tensor {name} has {exc}") from None
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise WeightsError(file, f"tensor {name} has ggml type {raw_type}, unknown to the "
                                 "gguf package: a type we cannot read (a newer llama.cpp "
                                 "quantization?)") from None  # fmt: skip
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape and shape[0] % block:
        raise WeightsError(file, f"corrupt: tensor {name} is {qtype.name} (blocks of {block}) "
                                 f"but its rows have {shape[0]} values")  # fmt: skip
    nbytes = math.prod(shape) // block * block_bytes
    return TensorInfo(name, qtype, shape, offset, nbytes)


def _alignment(file: Path, meta: dict[str, Any]) -> int:
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(align) is not int or align <= 0 or align & (align - 1):
        raise WeightsError(file, f"corrupt: general.alignment {align!r} is not a power of two")
    return align


def _check_names(file: Path, tensors: list[TensorInfo]) -> None:
    seen = set()
    for t in tensors:
        if t.name in seen:
            raise WeightsError(file, f"corrupt: two tensors are named {t.name}")
        seen.add(t.name)


def _check_extents(file: Path, tensors: list[TensorInfo], align: int, data: int) -> None:
    """The tensors' data back to back in the order of their infos, each padded to the
    alignment (llama.cpp refuses a file otherwise), and within the ``data`` bytes the file
    holds after its header (negative: it ends before the data starts)."""
    at = 0
    for t in tensors:
        if t.offset != at:
            raise WeightsError(file, f"corrupt: tensor {t.name}'s data is at offset {t.offset}; "
                                     f"the tensors before it end at {at}")  # fmt: skip
        at = -(-(at + t.nbytes) // align) * align
    last = tensors[-1].offset + tensors[-1].nbytes if tensors else 0
    if last > data:
        cut = next(t for t in tensors if t.offset + t.nbytes > data)
        raise WeightsError(file, f"truncated: the tensor infos describe {last} bytes of tensor "
                                 f"data, the file holds {max(data, 0)} (tensor {cut.name} is "
                                 "the first cut short)")  # fmt: skip


@functools.cache
def readable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` can read tensors of ``qtype`` (asked of one block
    of zeros: the package has no public list, and it grows with its version)."""
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _readable_names() -> list[str]:
    return [q.name for q in gguf.GGMLQuantizationType if readable(q)]
