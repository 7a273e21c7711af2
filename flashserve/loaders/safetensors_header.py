"""A safetensors file's header, read and checked before any of its data is.

The format: an 8-byte little-endian header length ``N``, ``N`` bytes of JSON mapping each
tensor's name to its ``dtype``, ``shape`` and ``data_offsets`` (``[begin, end)`` in the data
that follows), then the data: the tensors back to back, nothing before, between or after them
(the safetensors library refuses a file otherwise). A file cut short by a failed download or
copy, or overwritten, breaks one of these rules; checking them here turns the library's
``SafetensorError`` and its traceback into a ``WeightsError`` that says which file and what is
wrong, and costs one small read per file whatever the file's size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from flashserve.loaders.errors import WeightsError

HEADER_LIMIT = 100_000_000  # the safetensors library's own limit on the header's size
ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # what our parameters can take without loss
# model parameters are named so; checkpoints may also hold buffers of other dtypes (int64
# position ids, say) that the model skips
PARAMETER_SUFFIXES = (".weight", ".bias")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' name: F32, BF16, F8_E4M3, I32, ...
    shape: tuple[int, ...]


def read_header(file: Path, float8: bool = False) -> dict[str, TensorInfo]:
    """The tensors ``file`` holds, by name, from its header, once the header is whole and
    valid, the data holds exactly the bytes it describes, and every parameter (``*.weight``,
    ``*.bias``) is a float tensor (``float8``: F8_E4M3 weights too, a quantized checkpoint):
    WeightsError naming the file and the problem otherwise."""
    size = file.stat().st_size
    with file.open("rb") as f:
        length = f.read(8)
        if len(length) < 8:
            raise WeightsError(file, f"truncated: {size} bytes, too short for a safetensors file")
        n = int.from_bytes(length, "little")
        if n > HEADER_LIMIT:
            raise WeightsError(file, f"not a safetensors file: its first 8 bytes give a header "
                                     f"of {n} bytes (at most {HEADER_LIMIT})")  # fmt: skip
        if n > size - 8:
            raise WeightsError(file, f"truncated: the header alone is {n} bytes, the file has "
                                     f"{size - 8} after the header's length")  # fmt: skip
        raw = f.read(n)
    header = _parse(file, raw)
    header.pop("__metadata__", None)
    tensors, extents = {}, []
    for name, entry in header.items():
        info, begin, end = _entry(file, name, entry)
        tensors[name] = info
        extents.append((begin, end, name))
    _check_extents(file, extents, size - 8 - n)
    allowed = (*FLOAT_DTYPES, "F8_E4M3") if float8 else FLOAT_DTYPES
    for name, info in tensors.items():
        if info.dtype not in allowed and name.endswith(PARAMETER_SUFFIXES):
            raise WeightsError(file, f"tensor {name} is {info.dtype}: "
                                     f"{_unsupported(info.dtype, float8)}")  # fmt: skip
    return tensors


def _parse(file: Path, raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(file, f"corrupt: its header is not valid JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise WeightsError(file, "corrupt: its header is not a JSON object")
    return header


def _entry(file: Path, name: str, entry: object) -> tuple[TensorInfo, int, int]:
    """One header entry's tensor and its ``[begin, end)`` in the data, checked."""
    bad = WeightsError(file, f"corrupt: the header's entry for {name!r} is not a tensor "
                             f"(dtype, shape, data_offsets): {str(entry)[:120]}")  # fmt: skip
    if not isinstance(entry, dict):
        raise bad
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
        raise bad
    begin, end = offsets
    if any(d < 0 for d in shape) or not 0 <= begin <= end:
        raise bad
    need = math.prod(shape) * ITEM_BYTES.get(dtype, 0)
    if dtype in ITEM_BYTES and end - begin != need:
        raise WeightsError(file, f"corrupt: the header gives tensor {name} {end - begin} bytes; "
                                 f"{dtype} {shape} takes {need}")  # fmt: skip
    return TensorInfo(dtype, tuple(shape)), begin, end


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _check_extents(file: Path, extents: list[tuple[int, int, str]], data: int) -> None:
    """The tensors tile the ``data`` bytes after the header exactly."""
    last = max((end for _, end, _ in extents), default=0)
    if last > data:
        raise WeightsError(file, f"truncated: the header describes {last} bytes of tensor data, "
                                 f"the file holds {data}")  # fmt: skip
    at, prev = 0, None
    for begin, end, name in sorted(extents):
        if begin != at:
            where = f"tensors {prev} and {name} overlap" if begin < at else (
                f"{begin - at} bytes before tensor {name} belong to none")  # fmt: skip
            raise WeightsError(file, f"corrupt: {where}")
        at, prev = end, name
    if at < data:
        raise WeightsError(file, f"corrupt: {data - at} bytes after the last tensor belong to "
                                 "none (an appended or overwritten file?)")  # fmt: skip


def _unsupported(dtype: str, float8: bool) -> str:
    if dtype.startswith("F8") and not float8:
        return (
            "float8 weights, but config.json has no quantization_config to say how they are scaled"
        )
    if dtype.startswith("F8"):
        kind = "float8 weights other than e4m3 are"
    elif dtype == "BOOL" or dtype[0] in "IU":
        kind = "integer weights (a quantized checkpoint?) are"
    else:
        kind = "this dtype is"
    also = ", or F8_E4M3 with their scales" if float8 else ""
    return f"{kind} not supported: weights must be F32, F16 or BF16{also}"
