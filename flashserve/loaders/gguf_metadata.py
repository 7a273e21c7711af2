"""A fast reader for the key/value metadata at the head of a GGUF file.

``gguf.GGUFReader`` parses every field into numpy views and every tensor's header, which takes
seconds on a 49K-token vocabulary. Building a tokenizer only needs the metadata, read here in
one pass with `struct` (about 0.1 s for the default model).

Layout (little-endian): ``GGUF``, version u32, tensor count u64, key/value count u64, then for
each pair a string key, a u32 value type and the value. Strings are a u64 length plus UTF-8
bytes; arrays are an item type u32, a count u64 and the items.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

# GGUF value type -> struct format of a scalar of that type
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
_SCALARS[12] = "d"
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF values from a bytes buffer, front to back."""

    def __init__(self, data: bytes | mmap.mmap):
        self.data, self.pos = data, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.pos += n
        return self.data[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("I"), self.scalar("Q")
            return self.array(item, count)
        if kind not in _SCALARS:
            raise ValueError(f"GGUF: unknown value type {kind} at byte {self.pos}")
        return self.scalar(_SCALARS[kind])

    def array(self, item: int, count: int) -> list:
        if item in _SCALARS:  # one unpack for the whole array
            fmt = f"<{count}{_SCALARS[item]}"
            values = list(struct.unpack_from(fmt, self.data, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self.value(item) for _ in range(count)]


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every key/value of a GGUF file's metadata as ``{key: python value}`` (the same values
    ``GGUFReader``'s ``field.contents()`` gives). The file is memory-mapped; only the
    metadata's pages are read."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < 24 or data[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, _, num_kv = struct.unpack_from("<IQQ", data, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
        cursor = _Cursor(data)
        cursor.pos = 24
        meta = {}
        for _ in range(num_kv):
            key = cursor.string()
            meta[key] = cursor.value(cursor.scalar("I"))
    return meta
