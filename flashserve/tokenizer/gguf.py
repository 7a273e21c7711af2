"""A `tokenizers.Tokenizer` built in memory from a GGUF file's tokenizer metadata.

GGUF files carry no ``tokenizer.json``: llama.cpp stores the vocabulary, token types, merges and
special ids under ``tokenizer.ggml.*`` and names the pre-tokenizer in ``tokenizer.ggml.pre``.
Two vocabulary kinds are handled:

- ``gpt2``: byte-level BPE. Tokens are spelled in GPT-2's byte alphabet; the text is split by
  the pre-tokenizer regex of the model family before the merges apply.
- ``llama``: SentencePiece-style BPE with byte fallback (``<0x0A>`` tokens). Spaces become
  ``▁``, one is put before the text (and after each special token, as llama.cpp does), and
  merges come from the file or, when it has none, from the vocabulary and its scores.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from flashserve.loaders.gguf_metadata import read_gguf_metadata

log = logging.getLogger(__name__)

# the special token ids a GGUF file may give (tokenizer.ggml.<key>)
SPECIAL_ID_KEYS = (
    "bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id",
    "unknown_token_id", "padding_token_id",
)  # fmt: skip
# llama.cpp token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's pattern with numbers cut into single digits.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_SUFFIX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_SUFFIX}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_SUFFIX}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> regex split applied before the byte-level step.
REGEX_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("falcon3", "pixtral"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}
# Families whose numbers are cut into single digits, then split with GPT-2's regex.
DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
# Families that use GPT-2's regex as it is.
GPT2_SPLIT = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "trillion"}


def read_metadata(source: str | os.PathLike | Any) -> dict[str, Any]:
    """The ``tokenizer.*`` metadata of a GGUF file, as ``{key: python value}``.

    ``source`` is a path, an open ``gguf.GGUFReader``, or an already-read metadata mapping.
    """
    if isinstance(source, (str, os.PathLike)):
        source = read_gguf_metadata(source)
    elif not isinstance(source, Mapping):  # a GGUFReader
        source = {k: f.contents() for k, f in source.fields.items() if k.startswith("tokenizer.")}
    return {k: v for k, v in source.items() if k.startswith("tokenizer.")}


def pre_tokenizer(name: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer of the family ``tokenizer.ggml.pre`` names."""
    if name in REGEX_SPLITS:
        split = pre_tokenizers.Split(Regex(REGEX_SPLITS[name]), behavior="isolated")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if name not in GPT2_SPLIT and name is not None:
        log.warning("unknown GGUF pre-tokenizer %r: splitting text with GPT-2's regex", name)
    return gpt2


def build_backend(meta: Mapping[str, Any]) -> Backend:
    """A `tokenizers.Tokenizer` for the vocabulary ``meta`` describes (no post-processor)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("GGUF has no vocabulary (tokenizer.ggml.tokens): no tokenizer to build")
    for key in SPECIAL_ID_KEYS:
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and not (type(i) is int and 0 <= i < len(tokens)):
            raise ValueError(f"GGUF tokenizer.ggml.{key} {i} is not among its {len(tokens)} tokens")
    if kind == "gpt2":
        backend = _byte_level_bpe(meta)
    elif kind == "llama":
        backend = _sentencepiece_bpe(meta)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (gpt2 or llama)")
    _add_special_tokens(backend, meta)
    return backend


def byte_alphabet() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    spelled = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in spelled]
    spelled.update({b: chr(256 + i) for i, b in enumerate(others)})
    return spelled


def _byte_level_bpe(meta: Mapping[str, Any]) -> Backend:
    tokens, types = _tokens_and_types(meta)
    alphabet = byte_alphabet()
    chars = set(alphabet.values())

    def spell(token: str, kind: int) -> str:
        if kind in (CONTROL, USER_DEFINED) or set(token) <= chars:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = _vocab(spell(t, k) for t, k in zip(tokens, types))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(meta: Mapping[str, Any]) -> Backend:
    tokens, types = _tokens_and_types(meta)
    vocab = _vocab(tokens)
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        merges = derive_merges(tokens, types, scores)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    backend = Backend(model)
    # Like llama.cpp (and SentencePiece on plain text): one space before the text and before
    # the text after each special token, every space written as ▁.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    prepend = [normalizers.Prepend("▁")] if prefix else []
    backend.normalizer = normalizers.Sequence([*prepend, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []  # the space put before the text
    unescape = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(unescape + strip)
    return backend


def derive_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple]:
    """SentencePiece BPE merges recovered from the vocabulary: every split of a normal token
    into two tokens of the vocabulary, best-scored result first."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found = []
    for token, i in ids.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _tokens_and_types(meta: Mapping[str, Any]) -> tuple[list[str], list[int]]:
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    return tokens, [int(t) for t in types]


def _vocab(tokens) -> dict[str, int]:
    """Token -> id; a token spelled twice keeps its first id."""
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _add_special_tokens(backend: Backend, meta: Mapping[str, Any]) -> None:
    """Control tokens become special added tokens (matched whole in text, skippable when
    decoding); user-defined ones plain added tokens (matched whole, always decoded)."""
    tokens, types = _tokens_and_types(meta)
    specials = {meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown")}
    control = [t for i, (t, k) in enumerate(zip(tokens, types)) if k == CONTROL or i in specials]
    user = [t for t, k in zip(tokens, types) if k == USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
