"""The prompt tokenization cache (``flashserve.tokenizer.encode_cache``): a long text sent again
gets the ids a fresh tokenization gives, without tokenizing it; short texts, texts over the
budget and texts that only share a prefix are tokenized each time; the least recently used
go first."""

from __future__ import annotations

import random
import threading

import pytest

from flashserve.engine.prompts import PromptChecker
from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.encode_cache import EncodeCache


class CountingEncoder:
    """A tokenizer stand-in that counts its calls: one id per word, from a fixed vocabulary."""

    def __init__(self) -> None:
        self.calls = 0
        self.vocab: dict[str, int] = {}

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x" * rng.randint(1, 9)])
                    for _ in range(n))  # fmt: skip


def test_a_long_text_sent_again_is_not_tokenized_again():
    rng = random.Random()
    enc = CountingEncoder()
    cache = EncodeCache(enc, min_chars=100)
    text = words(2000, rng)
    first = cache(text)
    again = cache(text[:-1] + text[-1])  # an equal string, not the same object
    assert again == first == enc(text)
    assert enc.calls == 2  # the two calls above made one, the reference the other
    again.append(-1)  # each call returns a list of its own
    assert cache(text) == first


def test_short_texts_and_shared_prefixes_are_tokenized_each_time():
    rng = random.Random()
    enc = CountingEncoder()
    cache = EncodeCache(enc, min_chars=1000)
    short = words(20, rng)
    assert len(short) < 1000
    cache(short)
    cache(short)
    assert enc.calls == 2 and len(cache) == 0
    doc = words(1000, rng)
    cache(doc)
    asked = cache(doc + " alpha")
    assert asked == enc(doc + " alpha") and enc.calls == 5 and len(cache) == 2


def test_the_least_recently_used_go_first_within_the_budget():
    rng = random.Random()
    enc = CountingEncoder()
    texts = [words(400, rng) for _ in range(3)]
    one = EncodeCache(enc, min_chars=10)
    one(texts[0])
    size = one.nbytes
    cache = EncodeCache(enc, min_chars=10, max_bytes=int(2.5 * size))
    cache(texts[0])
    cache(texts[1])
    cache(texts[0])  # the first is now the most recent
    cache(texts[2])  # over the budget: the second goes
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    calls = enc.calls
    cache(texts[0])
    cache(texts[2])
    assert enc.calls == calls
    cache(texts[1])
    assert enc.calls == calls + 1


def test_a_text_over_the_whole_budget_is_not_kept():
    enc = CountingEncoder()
    cache = EncodeCache(enc, min_chars=10, max_bytes=1000)
    text = words(1000, random.Random())
    assert cache(text) == cache(text) and enc.calls == 2 and len(cache) == 0


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="min_chars"):
        EncodeCache(CountingEncoder(), min_chars=0)


def test_threads_get_the_ids_of_their_own_texts():
    rng = random.Random()
    enc = CountingEncoder()
    texts = [words(500, rng) for _ in range(4)]
    want = [enc(t) for t in texts]
    one = EncodeCache(enc, min_chars=10)
    one(texts[0])
    cache = EncodeCache(enc, min_chars=10, max_bytes=2 * one.nbytes)  # two or so: evictions too
    wrong = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(200):
            i = r.randrange(len(texts))
            if cache(texts[i]) != want[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_the_prompt_checker_tokenizes_a_repeated_prompt_once():
    """Through ``PromptChecker`` (what the HTTP front end and ``LLMEngine`` call), with the
    default model's BPE tokenizer: the ids of a repeated long prompt are the tokenizer's, its
    checks still run on every call."""
    from flashserve.loaders.load import default_model_path
    from flashserve.tokenizer.tokenizer import Tokenizer

    tiny_tokenizer = Tokenizer.from_gguf(default_model_path())
    calls = []
    encode = tiny_tokenizer.encode

    class Spy:
        def __getattr__(self, name):
            return getattr(tiny_tokenizer, name)

        def encode(self, text, add_special_tokens=True):
            calls.append(len(text))
            return encode(text, add_special_tokens=add_special_tokens)

    checker = PromptChecker(Spy(), vocab_size=tiny_tokenizer.vocab_size, max_model_len=10**6)
    text = words(3000, random.Random())
    params = SamplingParams(max_new_tokens=4)
    first = checker.checked_ids(text, params)
    assert checker.checked_ids(text, params) == first == encode(text)
    assert len(calls) == 1
    short = PromptChecker(Spy(), vocab_size=tiny_tokenizer.vocab_size, max_model_len=len(first))
    with pytest.raises(ValueError, match="over the context length"):
        short.checked_ids(text, params)
    with pytest.raises(ValueError, match="over the context length"):
        short.checked_ids(text, params)  # from the cache, checked the same
