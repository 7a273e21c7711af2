"""A fast reader for the key/value metadata at the head of a GGUF file, checked as it goes.

``gguf.GGUFReader`` parses every field into numpy views and every tensor's header, which takes
seconds on a 49K-token vocabulary. Building a tokenizer only needs the metadata, read here in
one pass with `struct` (about 0.1 s for the default model).

Layout (little-endian): ``GGUF``, version u32, tensor count u64, key/value count u64, then for
each pair a string key, a u32 value type and the value. Strings are a u64 length plus UTF-8
bytes; arrays are an item type u32, a count u64 and the items.

Every read is bounds-checked: a file cut short or overwritten fails with a ``WeightsError``
that names the file and where it ends (``GGUFReader`` raises numpy's errors from deep inside,
an IndexError among them, or reads past the end of its memory map without noticing).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

from flashserve.loaders.errors import WeightsError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # 1 had 32-bit counts and lengths; llama.cpp dropped it too
PREFIX = 24  # magic, version u32, tensor count u64, key/value count u64
# GGUF value type -> struct format of a scalar of that type
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9


class Overrun(Exception):
    """A read went past the end of the file (internal: the caller says where it was)."""


class Corrupt(Exception):
    """Bytes that no GGUF writer writes (internal: the caller names the file)."""


class Cursor:
    """Reads GGUF values from a bytes buffer, front to back, never past its end."""

    def __init__(self, data: bytes | mmap.mmap, pos: int = 0):
        self.data, self.pos = data, pos

    def skip(self, n: int) -> int:
        """Moves past ``n`` bytes, returning where they start."""
        if n > len(self.data) - self.pos:
            raise Overrun
        self.pos += n
        return self.pos - n

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.skip(struct.calcsize(fmt)))
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            return self.array(item, count)
        if kind not in _SCALARS:
            raise Corrupt(f"unknown value type {kind}")
        return self.scalar(_SCALARS[kind])

    def array(self, item: int, count: int) -> list:
        if item in _SCALARS:  # one unpack for the whole array
            n = count * struct.calcsize(_SCALARS[item])
            return list(struct.unpack_from(f"<{count}{_SCALARS[item]}", self.data, self.skip(n)))
        if item not in (_STRING, _ARRAY):
            raise Corrupt(f"an array of unknown value type {item}")
        if count > len(self.data):  # each item takes 8 bytes or more: a corrupt count
            raise Overrun
        if item == _STRING:
            return self.strings(count)
        return [self.value(item) for _ in range(count)]

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row, each a u64 length and UTF-8 bytes, read in one loop (a
        vocabulary and its merges are hundreds of thousands of them: half the time of a call
        each)."""
        data, pos, end = self.data, self.pos, len(self.data)
        length = struct.Struct("<Q").unpack_from
        out = []
        for _ in range(count):
            if end - pos < 8:
                raise Overrun
            (n,) = length(data, pos)
            pos += 8
            if n > end - pos:
                raise Overrun
            out.append(data[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


def read_prefix(file: Path, data: bytes | mmap.mmap) -> tuple[int, int, dict[str, Any], int]:
    """The version, the tensor count, the metadata ``{key: python value}`` and the offset where
    the tensor infos begin; WeightsError naming ``file`` if it is not a GGUF file we can read
    or ends inside these."""
    size = len(data)
    if data[: min(size, 4)] != MAGIC[: min(size, 4)]:
        raise WeightsError(file, f"not a GGUF file: it starts with {bytes(data[:4])!r}, not "
                                 f"{MAGIC!r}")  # fmt: skip
    if size < PREFIX:
        raise WeightsError(file, f"truncated: {size} bytes, too short for a GGUF file")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in VERSIONS:
            raise WeightsError(file, "a big-endian GGUF file: only little-endian ones are "
                                     "supported")  # fmt: skip
        raise WeightsError(file, f"GGUF version {version} is not supported "
                                 f"({' and '.join(map(str, VERSIONS))} are)")  # fmt: skip
    for count, what in ((num_tensors, "tensors"), (num_kv, "key/values")):
        if count > size:  # each takes more than a byte
            raise WeightsError(file, f"corrupt: its header counts {count} {what} in a file of "
                                     f"{size} bytes")  # fmt: skip
    cursor, meta, key, done = Cursor(data, PREFIX), {}, None, 0
    try:
        for done in range(num_kv):  # noqa: B007 (the count says where a cut file ends)
            key = None
            key = cursor.string()
            if key in meta:
                raise Corrupt("a second value (keys are unique)")
            meta[key] = cursor.value(cursor.scalar("I"))
    except Overrun:
        where = f"key/value {done + 1} of {num_kv}" + (f", {key}" if key is not None else "")
        raise WeightsError(file, f"truncated: the file ends in its metadata ({where}) at "
                                 f"{size} bytes") from None  # fmt: skip
    except Corrupt as exc:
        raise WeightsError(file, f"corrupt: metadata key {key} has {exc}") from None
    return version, num_tensors, meta, cursor.pos


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value of a GGUF file's metadata as ``{key: python value}`` (the same values
    ``GGUFReader``'s ``field.contents()`` gives). The file is memory-mapped; only the
    metadata's pages are read. WeightsError if it is not a GGUF file or is cut short."""
    path = Path(path)
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # mmap refuses empty files
            raise WeightsError(path, "truncated: 0 bytes, too short for a GGUF file")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return read_prefix(path, data)[2]
