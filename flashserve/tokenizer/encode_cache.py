"""The token ids of long prompts seen lately, so that a prompt sent again, or extended, is not
tokenized again whole.

A long prompt that comes back (a chat's "regenerate", a client's retry, a chat's next turn,
which resends the conversation so far) finds its KV in the prefix cache, and then its
tokenization is most of its time to first token: SmolLM2's BPE tokenizer takes 230 ms for
120,000 tokens of English (676K characters, one core of the CI machine), where an H200
prefills such a prompt from the prefix cache in 61-76 ms (``docs/benchmarks/serving.md``,
session 35).

``EncodeCache`` keeps the ids of the texts of at least ``min_chars`` characters, keyed by the
text itself (a hit compares the whole string: no digest is trusted), the least recently used
dropped once the texts and their ids pass ``max_bytes``. A text seen before gets its ids back.
A text that starts with a kept one's first ``min_chars`` characters and agrees with it past
one of its cut points (a special token, ``Tokenizer.cuts``: a chat template's turn markers)
takes the kept ids up to the last such point and tokenizes only the rest; where the tokenizer
offers no cuts (``cuts`` None) or the texts part before a cut, it is tokenized whole. Where
the tokenizer allows line cuts (``TextCuts.lines``: a letter after a newline), the latest line
start before the texts part is a cut point too, found when it is needed: the kept text's part
from there, tokenized alone, must give the kept ids' end (else no reuse), and the new text's
part from there is tokenized (a long document asked another question in the same message).
Such a cut is taken only where it leaves less than half of the new text to tokenize.
"""

from __future__ import annotations

import bisect
import sys
import threading
from array import array
from collections import OrderedDict
from typing import Protocol

from flashserve.tokenizer.cuts import Cuts, TextCuts


class Encoder(Protocol):
    cuts: TextCuts | None

    def encode(self, text: str) -> list[int]: ...


class _Kept:
    """A kept text's ids, its cut points (token index, character offset) and its bytes."""

    __slots__ = ("ids", "index", "chars", "nbytes")

    def __init__(self, text: str, cuts: Cuts) -> None:
        self.ids = array("i", cuts.ids)  # 4 bytes an id (a list of ints takes ~36)
        self.index = array("i", cuts.index)
        self.chars = array("i", cuts.chars)
        self.nbytes = sys.getsizeof(text) + 4 * (len(self.ids) + 2 * len(self.index))


class EncodeCache:
    """``tokenizer.encode`` with the ids of recent long texts kept and reused (module doc);
    thread-safe (the HTTP front end checks prompts on worker threads). Each call returns a
    list of its own. ``candidates``: how many of the latest kept texts with a new text's
    first ``min_chars`` characters it is compared with for a cut (many chats behind one long
    system prompt: each comparison reads both texts)."""

    def __init__(
        self, tokenizer: Encoder, min_chars: int = 4096, max_bytes: int = 64 << 20,
        candidates: int = 8,
    ) -> None:  # fmt: skip
        if min_chars < 1 or max_bytes < 0 or candidates < 0:
            raise ValueError(f"min_chars must be >= 1, max_bytes and candidates >= 0, got "
                             f"{min_chars}, {max_bytes}, {candidates}")  # fmt: skip
        self._tokenizer = tokenizer
        self.min_chars = min_chars
        self.max_bytes = max_bytes
        self.candidates = candidates
        self._kept: OrderedDict[str, _Kept] = OrderedDict()
        self._by_start: dict[str, list[str]] = {}  # first min_chars characters -> kept texts
        self._bytes = 0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        if len(text) < self.min_chars:
            return self._tokenizer.encode(text)
        cuts = self._tokenizer.cuts
        with self._lock:
            kept = self._kept.get(text)
            if kept is not None:
                self._kept.move_to_end(text)
                return kept.ids.tolist()
            same = self._by_start.get(text[: self.min_chars], []) if cuts else []
            candidates = [(t, self._kept[t]) for t in same[len(same) - self.candidates :]]
        # the rest outside the lock (a kept entry never changes): other prompts' lookups go on
        if cuts is None:
            whole = Cuts(self._tokenizer.encode(text), [], [])
        else:
            whole = _reuse(cuts, text, candidates, self.min_chars) or cuts.encode(text)
        self._keep(text, whole)
        return whole.ids

    @property
    def nbytes(self) -> int:
        """The bytes the kept texts, ids and cut points take."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def _keep(self, text: str, cuts: Cuts) -> None:
        try:
            kept = _Kept(text, cuts)
        except OverflowError:  # an id past 2^31: not kept
            return
        if kept.nbytes > self.max_bytes:
            return
        start = text[: self.min_chars]
        with self._lock:
            if text in self._kept:  # another thread kept it meanwhile
                return
            self._kept[text] = kept
            self._by_start.setdefault(start, []).append(text)
            self._bytes += kept.nbytes
            while self._bytes > self.max_bytes:
                old, gone = self._kept.popitem(last=False)
                self._bytes -= gone.nbytes
                same = self._by_start[old[: self.min_chars]]
                same.remove(old)
                if not same:
                    del self._by_start[old[: self.min_chars]]


def _reuse(
    cuts: TextCuts, text: str, candidates: list[tuple[str, _Kept]], known: int
) -> Cuts | None:
    """``text``'s ids and cut points from the latest cut of a candidate that ``text`` agrees
    with far enough past it (the first ``known`` characters agree), or None (no such cut, or
    its check failed)."""
    best: tuple[int, str, _Kept | None, int] = (0, "", None, 0)  # (character, text, entry, id)
    for other, kept in candidates:
        agree = _common_prefix(text, other, known)
        j = bisect.bisect_right(kept.chars, agree - cuts.max_chars) - 1
        if j >= 0 and kept.chars[j] > best[0]:
            best = (kept.chars[j], other, kept, kept.index[j])
        c = _line_start(other, agree - cuts.line_reach) if cuts.lines else 0
        if c > best[0] and 2 * (len(other) + len(text) - 2 * c) < len(text):
            best = (c, other, kept, -1)  # its id: found where it is used
    b, other, kept, k = best
    if kept is None:  # no cut past the first character
        return None
    if k < 0:  # a line start: the kept ids must end with its part from there alone
        ending = array("i", cuts.tokens(other[b:]))
        k = len(kept.ids) - len(ending)
        if k <= 0 or kept.ids[k:] != ending:
            return None
    return _extend(cuts, text, kept, k, b)


def _line_start(text: str, last: int, tries: int = 256) -> int:
    """The latest character at or before ``last`` that is a letter right after a newline (a
    line cut), or 0: among the last ``tries`` newlines before it."""
    end = last  # (rfind would count a negative end from the text's end)
    for _ in range(tries if last > 0 else 0):
        i = text.rfind("\n", 0, end)
        if i < 0:
            return 0
        if text[i + 1 : i + 2].isalpha():
            return i + 1
        end = i
    return 0


def _extend(cuts: TextCuts, text: str, head: _Kept, k: int, b: int) -> Cuts | None:
    """``text``'s ids and cut points: ``head``'s first ``k`` ids (those before its cut at
    character ``b``, where ``text`` agrees with it) and the rest of ``text`` tokenized; None
    where a special token's cut does not begin with that token (never reuse)."""
    tail = cuts.encode(text[b:], add_special_tokens=False)
    if k in head.index and (not tail.ids or tail.ids[0] != head.ids[k]):
        return None
    n = bisect.bisect_left(head.index, k)  # the head's cut points before k
    return Cuts(head.ids[:k].tolist() + tail.ids,
                head.index[:n].tolist() + [k + i for i in tail.index],
                head.chars[:n].tolist() + [b + c for c in tail.chars])  # fmt: skip


def _common_prefix(a: str, b: str, known: int) -> int:
    """How many first characters ``a`` and ``b`` share, given that the first ``known`` do:
    bisection over slices compared at C speed (a character loop would take ~30 ms at 676K)."""
    lo, hi = known, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
