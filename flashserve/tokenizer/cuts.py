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
"""

from __future__ import annotations

import json
from typing import NamedTuple

from tokenizers import Tokenizer as Backend

# components that work on each piece between special tokens alone, the same wherever it is
_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "Strip",
                "StripAccents", "Sequence"}  # fmt: skip
_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Whitespace", "WhitespaceSplit",
                   "Punctuation", "Metaspace", "Sequence"}  # fmt: skip


class Cuts(NamedTuple):
    """A tokenized text and its cut points: ``ids``, and for each special token it holds (not
    those the post-processor put in front), its index in ``ids`` and its character offset."""

    ids: list[int]
    index: list[int]
    chars: list[int]


class TextCuts:
    """The special tokens of one tokenizer that cut a text, and its encoding with their
    positions. ``max_chars``: the longest token matched as written, in characters (how far
    past a cut two texts must agree for it to stand in both)."""

    def __init__(self, backend: Backend, ids: set[int], max_chars: int, front: int) -> None:
        self._backend = backend
        self.ids = frozenset(ids)
        self.max_chars = max_chars
        self._front = front  # tokens the post-processor puts in front of a text

    @classmethod
    def of(cls, backend: Backend) -> TextCuts | None:
        """The cuts of ``backend``'s tokenizer, or None where its pipeline is not one whose
        pieces between special tokens are known to be tokenized alone (module doc)."""
        if not (_only(_spec(backend.normalizer), _NORMALIZERS)
                and _only(_spec(backend.pre_tokenizer), _PRE_TOKENIZERS)):  # fmt: skip
            return None
        added = backend.get_added_tokens_decoder()
        cut = {i for i, t in added.items()
               if t.special and not (t.normalized or t.lstrip or t.single_word)}  # fmt: skip
        if not cut:
            return None
        # the matching of every token matched as written looks this far ahead of a match
        reach = max(len(t.content) for t in added.values() if not t.normalized)
        probe = "a b"
        with_specials = backend.encode(probe).ids
        plain = backend.encode(probe, add_special_tokens=False).ids
        front = len(with_specials) - len(plain)
        if front < 0 or with_specials[front:] != plain:  # tokens after the text (an EOS)
            return None
        return cls(backend, cut, reach, front)

    def encode(self, text: str, add_special_tokens: bool = True) -> Cuts:
        """``text``'s ids (as ``Tokenizer.encode``) and its cut points."""
        enc = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        ids = enc.ids
        first = self._front if add_special_tokens else 0
        index = [i for i in range(first, len(ids)) if ids[i] in self.ids]
        return Cuts(ids, index, [enc.token_to_chars(i)[0] for i in index])


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
