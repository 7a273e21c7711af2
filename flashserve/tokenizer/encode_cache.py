"""The token ids of long prompts seen lately, so that a prompt sent again is not tokenized again.

A long prompt sent a second time (a chat's "regenerate", a client's retry, a benchmark's
repeated prompt) finds its KV in the prefix cache, and then its tokenization is most of its
time to first token: SmolLM2's BPE tokenizer takes 230 ms for 120,000 tokens of English (676K
characters, one core of the CI machine), where an H200 prefills such a prompt from the prefix
cache in about 70 ms (``docs/benchmarks/serving.md``, session 35).

``EncodeCache`` keeps the ids of the texts of at least ``min_chars`` characters, keyed by the
text itself (a hit compares the whole string, no digest is trusted), the least recently used
dropped once the texts and their ids pass ``max_bytes``. Only an exact repeat hits: a prompt
that shares a prefix with a cached one is tokenized whole (a tokenizer may merge across any
cut, so the cached part's ids are not reused).
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable


class EncodeCache:
    """``encode`` (text -> ids) with the ids of recent long texts kept; thread-safe (the HTTP
    front end checks prompts on worker threads). Each call returns a new list."""

    def __init__(
        self, encode: Callable[[str], list[int]], min_chars: int = 4096, max_bytes: int = 64 << 20
    ) -> None:
        if min_chars < 1 or max_bytes < 0:
            raise ValueError(f"min_chars must be >= 1 and max_bytes >= 0, got {min_chars}, "
                             f"{max_bytes}")  # fmt: skip
        self._encode = encode
        self.min_chars = min_chars
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, array] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if len(text) < self.min_chars:
            return self._encode(text)
        with self._lock:
            ids = self._entries.get(text)
            if ids is not None:
                self._entries.move_to_end(text)
                return ids.tolist()
        fresh = self._encode(text)  # outside the lock: other prompts' lookups go on
        self._keep(text, fresh)
        return fresh

    @property
    def nbytes(self) -> int:
        """The bytes the kept texts and ids take."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def _keep(self, text: str, ids: list[int]) -> None:
        try:
            packed = array("i", ids)  # 4 bytes an id (a list of ints takes ~36)
        except OverflowError:  # an id past 2^31: not kept
            return
        size = _size(text, packed)
        if size > self.max_bytes:
            return
        with self._lock:
            if text in self._entries:  # another thread kept it meanwhile
                return
            self._entries[text] = packed
            self._bytes += size
            while self._bytes > self.max_bytes:
                old, old_ids = self._entries.popitem(last=False)
                self._bytes -= _size(old, old_ids)


def _size(text: str, ids: array) -> int:
    return sys.getsizeof(text) + ids.itemsize * len(ids)
