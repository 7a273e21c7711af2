"""Synthetic prompts for ``bench serve``: random words from a fixed list, sized in tokens.

With a tokenizer (the server's, loaded locally) a prompt has the asked number of tokens as
that tokenizer counts them; without one its length is estimated at 1.3 tokens per word.
``extend_prompt`` sizes text appended to a prompt the same way (a question after a document,
the next turn of a chat), keeping the prompt's own tokens as they were, so that a server sees
the longer prompt start with exactly the tokens of the shorter one.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Protocol

WORDS = """
the of and to in is was for on that with as by at from his her it an were are which this be
or has had not but one their also its after first new two who they been other all more year
when time into there can over some than most people only would many years about world city
state part being she three during made under well between later while world history water
light river house music family early these such both where music school through city number
game north south east west small large great long high public city found known still group
system called second left right since often before power local place several however city
season film series book story night day work life home land sea mountain forest island road
bridge station market garden church castle village valley lake field stone iron gold silver
red blue green white black summer winter spring autumn morning evening letter paper window
door table chair kitchen teacher doctor student farmer engine machine wheel signal message
""".split()
TOKENS_PER_WORD = 1.3  # the estimate when no tokenizer is at hand (English BPE vocabularies)


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def load_tokenizer(spec: str) -> TokenizerLike:
    """The tokenizer of a model spec (``dummy:<preset>``, a Hugging Face directory, a
    ``.gguf`` file, or the default model's name as a server's /info gives it) without its
    weights; ValueError when the spec names none of these."""
    from flashserve.loaders.load import DEFAULT_FILE, default_model_path
    from flashserve.tokenizer.tokenizer import Tokenizer

    if spec.startswith("dummy:"):
        from flashserve.models.presets import preset_config

        c = preset_config(spec.removeprefix("dummy:"))
        return Tokenizer.byte_level(c.vocab_size, c.bos_token_id, c.eos_token_ids[0])
    if spec == Path(DEFAULT_FILE).stem:
        return Tokenizer.from_gguf(default_model_path())
    path = Path(spec).expanduser()
    if path.is_dir():
        return Tokenizer.from_dir(path)
    if path.suffix == ".gguf" and path.is_file():
        return Tokenizer.from_gguf(path)
    raise ValueError(f"no tokenizer at {spec!r}")


def sample_lengths(mean: int, spread: float, n: int, rng: random.Random) -> list[int]:
    """``n`` lengths uniform in ``[mean * (1 - spread), mean * (1 + spread)]``, at least 1."""
    lo, hi = round(mean * (1 - spread)), round(mean * (1 + spread))
    return [max(1, rng.randint(lo, hi)) for _ in range(n)]


def make_prompt(tokens: int, rng: random.Random, tokenizer: TokenizerLike | None) -> str:
    """Random words making ``tokens`` tokens (special tokens included) as ``tokenizer``
    counts them, or about that many without one."""
    if tokenizer is None:
        return _words(max(1, round(tokens / TOKENS_PER_WORD)), rng)
    special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
    want = max(1, tokens - special)
    ids: list[int] = []
    words = max(8, want)
    while len(ids) < want:
        ids = tokenizer.encode(_words(words, rng), add_special_tokens=False)
        words *= 2
    return tokenizer.decode(ids[:want])


def extend_prompt(
    prefix: str, tokens: int, rng: random.Random, tokenizer: TokenizerLike | None,
    tries: int = 8,
) -> tuple[str, int]:  # fmt: skip
    """(text to append to ``prefix``, tokens of ``prefix`` + that text with special tokens):
    a space and random words adding ``tokens`` tokens to ``prefix`` as ``tokenizer`` counts
    them, whose start leaves the tokens of ``prefix`` unchanged (a tokenizer could merge
    across the seam; a space is a pre-tokenizer split in the BPE and SentencePiece vocabularies
    seen here, and a candidate that still changes them is drawn again, up to ``tries`` times;
    the last one is kept, its count exact). Without a tokenizer the count is estimated."""
    if tokenizer is None:
        words = max(1, round(tokens / TOKENS_PER_WORD))
        return " " + _words(words, rng), round((len(prefix.split()) + words) * TOKENS_PER_WORD)
    special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
    base = tokenizer.encode(prefix, add_special_tokens=False)
    n, want = len(base), len(base) + max(1, tokens)
    words, suffix, ids = max(8, tokens), "", base
    for _ in range(tries):
        ids = tokenizer.encode(prefix + " " + _words(words, rng), add_special_tokens=False)
        while len(ids) < want:  # too few words: draw twice as many
            words *= 2
            ids = tokenizer.encode(prefix + " " + _words(words, rng), add_special_tokens=False)
        text = tokenizer.decode(ids[:want])
        if text.startswith(prefix):
            suffix = text[len(prefix) :]
        else:  # a decoder that does not give ``prefix`` back (normalized spaces)
            suffix = " " + tokenizer.decode(ids[n:want])
        ids = tokenizer.encode(prefix + suffix, add_special_tokens=False)
        if len(ids) == want and ids[:n] == base:  # decoding and encoding again round-trips
            break
    return suffix, len(ids) + special


def _words(n: int, rng: random.Random) -> str:
    """``n`` random words, a line break after every 16th (as a document's text has them: a
    server's tokenizer may reuse a long prompt's ids up to a line start, ``EncodeCache``)."""
    return "".join(rng.choice(WORDS) + ("\n" if i % 16 == 15 else " ") for i in range(n))[:-1]
