"""Incremental detokenizer: streamed pieces add up to the full decode, never hold a broken
character, and the work per token stays bounded."""

from __future__ import annotations

import random

import pytest
from tokenizer_helpers import HARD_TEXTS, build_spm_gguf, default_gguf_path, first_diff, random_text

from flashserve.tokenizer.detokenizer import MAX_PENDING, REPLACEMENT, IncrementalDetokenizer
from flashserve.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smollm():
    return Tokenizer.from_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    return Tokenizer.from_gguf(build_spm_gguf(tmp_path_factory.mktemp("spm"))[1])


@pytest.fixture(scope="module")
def tokenizers(smollm, spm):
    return {"smollm": smollm, "spm": spm, "bytes": Tokenizer.byte_level(512, 1, 2)}


def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    """The pieces `add` returns for each id, then what `flush` returns."""
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:"), skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


def check_stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    pieces = stream(tok, ids, skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    joined = "".join(pieces)
    assert joined == full, f"stream of {ids}: {first_diff(joined, full)}"
    if REPLACEMENT not in full:
        bad = [i for i, p in enumerate(pieces) if REPLACEMENT in p]
        assert not bad, f"piece {bad[0]} of {ids} holds a broken character: {pieces}"
    return pieces


@pytest.mark.parametrize("name", ["smollm", "spm", "bytes"])
@pytest.mark.parametrize("skip", [True, False])
def test_stream_equals_decode_on_hard_texts(tokenizers, name, skip):
    tok = tokenizers[name]
    for text in HARD_TEXTS:
        check_stream(tok, tok.encode(text, add_special_tokens=False), skip)


@pytest.mark.parametrize("name", ["smollm", "spm", "bytes"])
def test_stream_equals_decode_on_random_text(tokenizers, name):
    tok = tokenizers[name]
    rng = random.Random(random.getrandbits(32))
    for _ in range(150):
        text = random_text(rng, 60)
        check_stream(tok, tok.encode(text, add_special_tokens=False), rng.random() < 0.5)


@pytest.mark.parametrize("text", ["👋", "👨‍👩‍👧", "語", "é", "🇫🇷"])
def test_split_character_comes_out_whole(smollm, text):
    """Byte-level tokens that cut a character give "" until the character is complete."""
    ids = smollm.encode("Hi " + text, add_special_tokens=False)
    pieces = check_stream(smollm, ids)
    assert "".join(pieces) == "Hi " + text
    for piece in pieces:  # every piece is whole characters of the text, in order
        assert piece == "" or piece in "Hi " + text, pieces
    emoji = smollm.encode("👋", add_special_tokens=False)
    assert len(emoji) > 1, "the test needs an emoji that takes several tokens"
    assert stream(smollm, emoji)[:-1] == [""] * (len(emoji) - 1) + ["👋"]


def test_sentencepiece_spaces(spm):
    """A lone "▁world" decodes to "world"; in a stream it must keep its space."""
    ids = spm.encode("Hello world  and   more", add_special_tokens=False)
    pieces = check_stream(spm, ids)
    assert pieces[0] == spm.decode(ids[:1]) and not pieces[0].startswith(" ")
    assert any(p.startswith(" ") for p in pieces[1:])


def test_special_tokens_skipped_or_kept(smollm):
    ids = smollm.encode("<|im_start|>assistant\nOui 🇫🇷<|im_end|>", add_special_tokens=False)
    assert "".join(stream(smollm, ids, skip=True)) == "assistant\nOui 🇫🇷"
    assert "".join(stream(smollm, ids, skip=False)).endswith("🇫🇷<|im_end|>")


@pytest.mark.parametrize("name", ["smollm", "bytes"])
def test_random_ids_including_invalid_bytes(tokenizers, name):
    """Arbitrary ids (lone UTF-8 bytes, unfinished characters, specials) still add up."""
    tok = tokenizers[name]
    rng = random.Random(random.getrandbits(32))
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        check_stream(tok, ids, skip=rng.random() < 0.5)


@pytest.mark.parametrize("valid", [False, True])
def test_long_run_of_invalid_bytes_is_bounded(valid):
    """Past MAX_PENDING tokens of broken UTF-8 the text goes out, cut where later tokens
    cannot change it: here before the bytes of a euro sign whose last byte comes later."""
    tok = Tokenizer.byte_level(512, 300, 301)  # byte b has id b
    garbage = [0xC3] * (2 * MAX_PENDING - 2)  # lead bytes with no continuation
    euro = list("€".encode()) if valid else [0xE2, 0x82, 0x41]
    pieces = check_stream(tok, garbage + euro + list(b"ok"))
    assert any(pieces[: MAX_PENDING + 1]), "broken bytes were held back without a bound"
    tail = "€" if valid else REPLACEMENT + "A"  # E2 82 then "A": one U+FFFD
    assert pieces[-4].endswith(tail) and pieces[-3:-1] == ["o", "k"], pieces


def test_window_stays_small(smollm):
    """The per-token work is bounded: the decode window never grows with the output."""
    text = " ".join(HARD_TEXTS) * 20
    ids = smollm.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm, [], skip_special_tokens=False)
    longest = 0
    for i in ids:
        detok.add(i)
        longest = max(longest, len(detok._window))
    assert len(ids) > 2000 and longest <= 2 * MAX_PENDING
