"""Where a text's tokenization can be cut: before a special token, the text after it is
tokenized as if it began there. So a prompt that extends a tokenized one (a chat's next turn,
which resends the conversation so far) needs only its part from the last such token on
tokenized again (``flashserve.tokenizer.encode_cache``).

Why this holds, for the pipelines ``TextCuts.of`` accepts: a `tokenizers.Tokenizer` first cuts
the text at its special added tokens (those matched as written: not normalized, no stripping
of the spaces to their left, not whole-word only; leftmost-longest matches), then normalizes,
pre-tokenizes and runs its model on each piece between them on its own, and its post-processor
may put tokens (BOS) in front of the whole. So with a special token starting at character
``b`` of a text ``T``, ``encode(T) == encode(T[:b]) + encode(T[b:], no special tokens)``, and
the first part is the same for any text that agrees with ``T`` on ``b + (the longest special
token)`` characters (the matching of special tokens looks no further ahead). A normalizer or
pre-tokenizer that treats the first piece of a text apart (``Metaspace`` with
``prepend_scheme: first``), one not listed below, or a post-processor that adds tokens after
the text, and no cut is offered (``of`` returns None).

Line cuts (``TextCuts.lines``): where a text's character ``c`` is a letter right after a
newline, ``encode(T) == encode(T[:c]) + encode(T[c:], no special tokens)`` too, for the
pipelines whose pre-tokenizer splits with one of the regexes below (GPT-2's, Llama 3's,
Qwen2's, GPT-4o's), or on whitespace, and otherwise only cuts pieces further (no prefix
space, no ``Metaspace``), under per-character normalizers. In those regexes no alternative
takes a newline and a letter after it (the letter runs' optional first character excludes
``\r\n``), and every match that ends at or before ``c`` is decided by the characters up to
``c``; so ``c`` starts a piece, the pieces before it are the same in any text that agrees
with ``T`` through ``c``, and those from ``c`` on are the regex run from ``c`` (none looks
behind). Added tokens are matched before any of it: the texts must agree past ``c`` by the
longest one's length (``line_reach``; four times it, for tokens matched after a normalizer
that may change lengths), and a match that crosses ``c`` is caught where the cut is used
(``encode_cache``: the kept text's own ids must end with its part from ``c`` tokenized alone).
This is what a long document asked one question after another needs, where no special token
falls between the document and each question.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from tokenizers import Tokenizer as Backend

from flashserve.tokenizer.gguf import REGEX_SPLITS

# components that work on each piece between special tokens alone, the same wherever it is
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Strip",
                "StripAccents", "Sequence"}  # fmt: skip
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Whitespace", "WhitespaceSplit",
                   "Punctuation", "Metaspace", "Sequence"}  # fmt: skip
# line cuts (module doc): per-character normalizers, and the pre-tokenizer regexes after which
# a letter that follows a newline always starts a piece
_LINE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Sequence"}
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LINE_REGEXES = frozenset({_GPT2_REGEX, *REGEX_SPLITS.values()})


class Cuts(NamedTuple):
    """A tokenized text and its cut points: ``ids``, and for each special token it holds (not
    those the post-processor put in front), its index in ``ids`` and its character offset."""

    ids: list[int]
    index: list[int]
    chars: list[int]


class TextCuts:
    """The special tokens of one tokenizer that cut a text, and its encoding with their
    positions. ``max_chars``: the longest token matched as written, in characters (how far
    past a cut two texts must agree for it to stand in both). ``lines``: whether a letter
    after a newline is a cut too, where texts agree ``line_reach`` characters past it."""

    def __init__(
        self, backend: Backend, ids: set[int], max_chars: int, front: int, lines: bool = False,
        line_reach: int = 1,
    ) -> None:  # fmt: skip
        self._backend = backend
        self.ids = frozenset(ids)
        self.max_chars = max_chars
        self._front = front  # tokens the post-processor puts in front of a text
        self.lines = lines
        self.line_reach = line_reach

    @classmethod
    def of(cls, backend: Backend) -> TextCuts | None:
        """The cuts of ``backend``'s tokenizer, or None where its pipeline is not one whose
        pieces between special tokens are known to be tokenized alone (module doc)."""
        norm, pre = _spec(backend.normalizer), _spec(backend.pre_tokenizer)
        if not (_only(norm, _NORMALIZERS) and _only(pre, _PRE_TOKENIZERS)):
            return None
        added = backend.get_added_tokens_decoder()
        cut = {i for i, t in added.items()
               if t.special and not (t.normalized or t.lstrip or t.single_word)}  # fmt: skip
        lines = _only(norm, _LINE_NORMALIZERS) and _splits_lines(pre) is True
        if not (cut or lines):
            return None
        # the matching of every token matched as written looks this far ahead of a match
        reach = max((len(t.content) for t in added.values() if not t.normalized), default=0)
        longest = max((len(t.content) for t in added.values()), default=0)
        line_reach = (4 if norm else 1) * longest + 1
        probe = "a b"
        with_specials = backend.encode(probe).ids
        plain = backend.encode(probe, add_special_tokens=False).ids
        front = len(with_specials) - len(plain)
        if front < 0 or with_specials[front:] != plain:  # tokens after the text (an EOS)
            return None
        return cls(backend, cut, reach, front, lines, line_reach)

    def encode(self, text: str, add_special_tokens: bool = True) -> Cuts:
        """``text``'s ids (as ``Tokenizer.encode``) and its cut points."""
        enc = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids = enc.ids
        first = self._front if add_special_tokens else 0
        index = [i for i in range(first, len(ids)) if ids[i] in self.ids]
        return Cuts(ids, index, [enc.token_to_chars(i)[0] for i in index])

    def tokens(self, text: str) -> list[int]:
        """``text``'s ids, no special tokens added in front (a part from a cut on)."""
        return self._backend.encode_batch([text], add_special_tokens=False)[0].ids


def _spec(component) -> dict | None:
    """A normalizer's or pre-tokenizer's ``tokenizer.json`` entry (the whole file would take
    ~100 ms to write for a 50K vocabulary)."""
    return None if component is None else json.loads(component.__getstate__())


def _only(spec: dict | None, allowed: set[str]) -> bool:
    """Whether a normalizer / pre-tokenizer spec (``tokenizer.json``'s) uses only ``allowed``
    types, and no ``Metaspace`` that treats a text's first piece apart."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in allowed:
        return False
    if kind == "Metaspace" and spec.get("prepend_scheme", "always") == "first":
        return False
    parts = spec.get("normalizers") or spec.get("pretokenizers") or []
    return all(_only(p, allowed) for p in parts)


def _splits_lines(spec: dict | None) -> bool | None:
    """For a pre-tokenizer spec: True where it starts a piece at every letter after a
    newline and looks at no text before a piece's start (module doc), False where it only
    cuts pieces further without looking back, None otherwise (no line cuts)."""
    if spec is None:
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        parts = [_splits_lines(p) for p in spec.get("pretokenizers", [])]
        return None if None in parts else any(parts)
    if kind == "Split":
        pattern = (spec.get("pattern") or {}).get("Regex")
        ok = pattern in _LINE_REGEXES and spec.get("behavior") == "Isolated"
        return True if ok and not spec.get("invert") else None
    if kind == "ByteLevel":
        return None if spec.get("add_prefix_space") else bool(spec.get("use_regex", True))
    if kind in ("Whitespace", "WhitespaceSplit"):
        return True
    return False if kind in ("Digits", "Punctuation") else None
