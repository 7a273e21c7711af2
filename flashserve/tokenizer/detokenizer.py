"""Turning a stream of generated token ids into a stream of text, one token at a time.

Decoding token by token does not work: a token may hold part of a UTF-8 character (emoji and
CJK often take two or three byte-level tokens), and SentencePiece decoders drop the space at
the start of the text they decode, so ``"▁world"`` alone decodes to ``"world"``. Instead each
step decodes a short window of recent tokens twice, without and with the new ones, and emits
the difference:

    window = [ .. already emitted .. | .. pending .. ]
              prefix                 read

``decode(window)[len(decode(prefix part)):]`` is the new text. When it ends in U+FFFD (an
unfinished character) nothing is emitted and the tokens stay pending; once the character is
complete, the whole of it comes out. The window then slides so that the tokens just emitted
become the left context, which keeps the cost per token constant.
"""

from __future__ import annotations

from collections.abc import Sequence

from flashserve.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
# Tokens held back at most while the text ends in U+FFFD. A character is at most 4 bytes, so
# 4 pending tokens may still complete one; past this limit the text up to a safe cut goes out
# (the bytes there are invalid UTF-8, and stay U+FFFD however the stream goes on).
MAX_PENDING = 8


class IncrementalDetokenizer:
    """Text deltas of one sequence's output tokens.

    The concatenation of everything `add` returns, plus `flush` at the end, equals
    ``tokenizer.decode(output_ids, skip_special_tokens)``; no piece ends in a broken character.

    ``prompt_ids`` is accepted but not used as left context: that would make SentencePiece
    output start with a space that ``decode`` of the output alone does not have.

    One known gap: SentencePiece byte-fallback decoding turns a whole run of ``<0x..>`` tokens
    into U+FFFDs when any byte of it is invalid, so a stray invalid byte right after a complete
    byte-fallback character makes the full decode show U+FFFD where the stream has already
    sent the character. Byte-level BPE (GPT-2 style) has no such case.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # emitted context tokens, then pending ones
        self._read = 0  # index in _window of the first pending token
        self._emitted = ""  # decode(_window[:_read]): text already returned for the context

    def add(self, token_id: int) -> str:
        """The text ``token_id`` adds: "" while a character is unfinished, then all of it."""
        if self.skip_special_tokens and self.tokenizer.is_special(token_id):
            return ""  # decode drops it; keeping it out of the window keeps the context real
        self._window.append(token_id)
        text = self._decode(self._window)
        if not text.endswith(REPLACEMENT):
            return self._emit(len(self._window), text)
        if len(self._window) - self._read < MAX_PENDING:
            return ""
        return self._emit(*self._safe_cut(text))

    def flush(self) -> str:
        """Text still held back at the end of the sequence (bytes of no complete character)."""
        if self._read == len(self._window):
            return ""
        return self._emit(len(self._window), self._decode(self._window))

    def _safe_cut(self, full: str) -> tuple[int, str]:
        """Too many tokens pending: the latest point at which the text can be cut for good,
        and the text before it (``full`` is the decode of the whole window).

        A cut is safe where decoding the two sides apart gives the same text as decoding them
        together, and at least 3 tokens stay pending: an unfinished character is at most 3
        bytes, so future tokens can only change text after the cut.
        """
        for end in range(len(self._window) - 3, self._read, -1):
            head = self._decode(self._window[:end])
            if head + self._decode(self._window[end:]) == full:
                return end, head
        return len(self._window), full

    def _emit(self, end: int, text: str) -> str:
        """Return ``text`` (the decode of ``_window[:end]``) past what is already out; the tokens
        up to ``end`` become the context, those after it stay pending."""
        delta = text[len(self._emitted) :]
        self._window = self._window[self._read :]
        self._read = end - self._read
        self._emitted = self._decode(self._window[: self._read])
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
