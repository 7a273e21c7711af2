"""The prompt tokenization cache (``flashserve.tokenizer.encode_cache``) and the cut points it
reuses ids at (``flashserve.tokenizer.cuts``): every id list it returns is compared with a
fresh tokenization of the same text, on real tokenizers (the default model's BPE, a
SentencePiece GGUF, the byte-level stand-in) and growing conversations of random text; a long
text sent again is not tokenized again, an extended one only from its last cut on; short
texts, texts over the budget and tokenizers without cuts are tokenized whole; the least
recently used go first."""

from __future__ import annotations

import contextlib
import json
import random
import threading

import pytest
from tokenizer_helpers import HARD_TEXTS, build_spm_gguf, default_gguf_path, first_diff, random_text

from flashserve.engine.prompts import PromptChecker
from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.cuts import TextCuts
from flashserve.tokenizer.encode_cache import EncodeCache
from flashserve.tokenizer.tokenizer import Tokenizer


class CountingEncoder:
    """A tokenizer stand-in without cuts that counts its calls: one id per word."""

    cuts = None

    def __init__(self) -> None:
        self.calls = 0
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        self.calls += 1
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "x" * rng.randint(1, 9)])
                    for _ in range(n))  # fmt: skip


@contextlib.contextmanager
def tails_of(tok: Tokenizer):
    """The texts the cache tokenizes from a cut on (no special tokens added in front), as a
    list that fills while the block runs."""
    tails: list[str] = []
    real = tok.cuts.encode

    def spy(text, add_special_tokens=True):
        if not add_special_tokens:
            tails.append(text)
        return real(text, add_special_tokens)

    tok.cuts.encode = spy
    try:
        yield tails
    finally:
        del tok.cuts.encode


@pytest.fixture(scope="module")
def tokenizers_with_cuts(tmp_path_factory):
    """(name, tokenizer, its special tokens' texts) for each kind we build."""
    spm = Tokenizer.from_gguf(build_spm_gguf(tmp_path_factory.mktemp("spm"))[1])
    return [
        ("gguf-bpe", Tokenizer.from_gguf(default_gguf_path()), ["<|im_start|>", "<|im_end|>",
                                                               "<|endoftext|>", "<file_sep>"]),
        ("gguf-spm", spm, ["<s>", "</s>"]),
        ("byte-level", Tokenizer.byte_level(300, 256, 257), ["<|bos|>", "<|eos|>"]),
    ]  # fmt: skip


def test_a_long_text_sent_again_is_not_tokenized_again():
    rng = random.Random()
    enc = CountingEncoder()
    cache = EncodeCache(enc, min_chars=100)
    text = words(2000, rng)
    first = cache(text)
    again = cache(text[:-1] + text[-1])  # an equal string, not the same object
    assert again == first == enc.encode(text)
    assert enc.calls == 2  # the two calls above made one, the reference the other
    again.append(-1)  # each call returns a list of its own
    assert cache(text) == first


def test_short_texts_and_texts_without_cuts_are_tokenized_whole():
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
    asked = cache(doc + " alpha")  # no cuts: the longer text is tokenized whole
    assert asked == enc.encode(doc + " alpha") and enc.calls == 5 and len(cache) == 2


def _conversation(rng: random.Random, specials: list[str], turns: int, size: int) -> list[str]:
    """A growing text: each element extends the one before by a random turn (special tokens
    around random text, the hard texts, pieces of special-token text), as chats resend."""
    texts, text = [], ""
    for _ in range(turns):
        parts = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.3:
                parts.append(rng.choice(specials))
            elif kind < 0.4:
                parts.append(rng.choice(HARD_TEXTS))
            elif kind < 0.5:  # a special token's text cut short, or with spaces around
                s = rng.choice(specials)
                parts.append(rng.choice([s[: rng.randint(1, len(s) - 1)], f" {s} ", s + "\n"]))
            else:
                parts.append(random_text(rng, size))
        text += "".join(parts)
        texts.append(text)
    return texts


def test_extended_texts_get_the_ids_of_a_fresh_tokenization(tokenizers_with_cuts):
    rng = random.Random()
    for name, tok, specials in tokenizers_with_cuts:
        assert tok.cuts is not None, name
        with tails_of(tok) as tails:
            for _ in range(30):
                cache = EncodeCache(tok, min_chars=rng.choice([1, 8, 64]))
                texts = _conversation(rng, specials, rng.randint(2, 8), rng.choice([8, 60]))
                for text in texts + rng.sample(texts, len(texts) // 2):  # some sent again
                    want = tok.encode(text)
                    got = cache(text)
                    assert got == want, f"{name}: {text!r}: {first_diff(got, want)}"
        assert len(tails) > 30, name  # ids reused, only the rest tokenized


def test_a_chat_turn_is_tokenized_from_the_last_turn_marker_on():
    tok = Tokenizer.from_gguf(default_gguf_path())
    rng = random.Random()
    messages = [{"role": "user", "content": words(3000, rng)}]
    encoded = []
    real = tok.cuts.encode
    tok.cuts.encode = lambda text, add_special_tokens=True: (
        encoded.append(text) or real(text, add_special_tokens))  # fmt: skip
    try:
        cache = EncodeCache(tok)
        for turn in range(3):
            text = tok.apply_chat_template(messages)
            assert cache(text) == tok.encode(text)
            if turn:  # from the last turn's marker: the new turns only
                assert encoded[-1].startswith("<|im_start|>assistant\n")
                assert len(encoded[-1]) < len(text) / 4
            messages += [{"role": "assistant", "content": words(50, rng)},
                         {"role": "user", "content": words(50, rng)}]  # fmt: skip
    finally:
        del tok.cuts.encode
    assert len(encoded) == 3


def test_pipelines_that_treat_a_texts_start_apart_offer_no_cuts():
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    def backend(pre=None, post=None, norm=None):
        b = Backend(models.WordLevel({"a": 0, "▁a": 1, "b": 2, "<s>": 3, "[UNK]": 4}, "[UNK]"))
        b.pre_tokenizer, b.post_processor, b.normalizer = pre, post, norm
        b.add_special_tokens([AddedToken("<s>", special=True)])
        return b

    assert TextCuts.of(backend(pre_tokenizers.WhitespaceSplit())) is not None
    first = pre_tokenizers.Metaspace(prepend_scheme="first")
    assert TextCuts.of(backend(first)) is None
    assert TextCuts.of(backend(pre_tokenizers.Sequence([pre_tokenizers.Digits(), first]))) is None
    assert TextCuts.of(backend(pre_tokenizers.Metaspace(prepend_scheme="always"))) is not None
    eos = processors.TemplateProcessing(single="$A <s>", special_tokens=[("<s>", 3)])
    assert TextCuts.of(backend(pre_tokenizers.WhitespaceSplit(), eos)) is None
    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    assert TextCuts.of(backend(pre_tokenizers.WhitespaceSplit(), bos)) is not None
    odd = normalizers.BertNormalizer()  # not on the list of per-piece normalizers
    assert TextCuts.of(backend(pre_tokenizers.WhitespaceSplit(), norm=odd)) is None
    assert json.loads(backend(first).to_str())["pre_tokenizer"]["prepend_scheme"] == "first"


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
    tok = Tokenizer.from_gguf(default_gguf_path())
    rng = random.Random()
    texts = _conversation(rng, ["<|im_start|>", "<|im_end|>"], 6, 80)
    want = [tok.encode(t) for t in texts]
    one = EncodeCache(tok, min_chars=10)
    one(texts[-1])
    cache = EncodeCache(tok, min_chars=10, max_bytes=2 * one.nbytes)  # evictions too
    wrong = []

    def work(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(100):
            i = r.randrange(len(texts))
            if cache(texts[i]) != want[i]:
                wrong.append(i)

    threads = [threading.Thread(target=work, args=(rng.random(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_the_prompt_checker_tokenizes_a_repeated_prompt_once():
    """Through ``PromptChecker`` (what the HTTP front end and ``LLMEngine`` call), with the
    default model's tokenizer: a repeated long prompt's ids are the tokenizer's, tokenized
    once, and its checks still run on every call."""
    tok = Tokenizer.from_gguf(default_gguf_path())
    calls = []
    real = tok.cuts.encode
    tok.cuts.encode = lambda text, add_special_tokens=True: (
        calls.append(len(text)) or real(text, add_special_tokens))  # fmt: skip
    checker = PromptChecker(tok, vocab_size=tok.vocab_size, max_model_len=10**6)
    text = words(3000, random.Random())
    params = SamplingParams(max_new_tokens=4)
    first = checker.checked_ids(text, params)
    assert checker.checked_ids(text, params) == first == tok.encode(text)
    assert len(calls) == 1
    short = PromptChecker(tok, vocab_size=tok.vocab_size, max_model_len=len(first))
    with pytest.raises(ValueError, match="over the context length"):
        short.checked_ids(text, params)
    with pytest.raises(ValueError, match="over the context length"):
        short.checked_ids(text, params)  # from the cache, checked the same


def test_only_the_latest_kept_texts_are_compared_for_a_cut():
    tok = Tokenizer.from_gguf(default_gguf_path())
    rng = random.Random()
    start = "<|im_start|>system\n" + "x" * 100  # one start, then each chat its own
    chats = [f"{start} {words(300, rng)}<|im_end|>\n<|im_start|>user\n{words(50, rng)}<|im_end|>\n"
             for _ in range(4)]  # fmt: skip
    with tails_of(tok) as tails:
        cache = EncodeCache(tok, min_chars=64, candidates=2)
        for chat in chats:
            cache(chat)
        turn = "<|im_start|>assistant\nok<|im_end|>\n"
        assert cache(chats[0] + turn) == tok.encode(chats[0] + turn)  # not among the latest 2
        assert not tails
        assert cache(chats[3] + turn) == tok.encode(chats[3] + turn)
        # from the last line start (the user's words after "<|im_start|>user\n")
        assert tails == [chats[3][chats[3].rindex("user\n") + 5 :] + turn]


def _bpe_with(pre: str, nfc: bool = False) -> Tokenizer:
    """The default model's vocabulary and merges behind another family's pre-tokenizer
    (``tokenizer.ggml.pre``), under NFC where asked (as Qwen2's ``tokenizer.json`` has it)."""
    from tokenizers import normalizers

    from flashserve.tokenizer import gguf as gguf_tokenizer

    meta = dict(gguf_tokenizer.read_metadata(default_gguf_path()), **{"tokenizer.ggml.pre": pre})
    backend = gguf_tokenizer.build_backend(meta)
    if nfc:
        backend.normalizer = normalizers.NFC()
    return Tokenizer(backend, eos_token_ids=[2])


def _document(rng: random.Random, lines: int) -> str:
    """Lines of random text (scripts, emoji, digits, whitespace runs, CRLF, the hard texts)."""
    parts = []
    for _ in range(lines):
        line = random_text(rng, 30) if rng.random() < 0.8 else rng.choice(HARD_TEXTS)
        end = rng.choice(["\n", "\n", "\n\n", "\r\n"])
        parts.append(rng.choice(["", "", " ", "\t"]) + line + end)
    return "".join(parts)


@pytest.fixture(scope="module")
def tokenizers_with_line_cuts(tokenizers_with_cuts):
    byname = {name: tok for name, tok, _ in tokenizers_with_cuts}
    return [("gguf-bpe", byname["gguf-bpe"]), ("byte-level", byname["byte-level"]),
            ("llama3-regex", _bpe_with("llama-bpe")), ("qwen2-regex-nfc", _bpe_with("qwen2", True)),
            ("gpt-4o-regex", _bpe_with("gpt-4o"))]  # fmt: skip


def test_questions_after_a_document_reuse_its_ids_up_to_a_line_start(tokenizers_with_line_cuts):
    """A document asked one question after another, with no special token between them: each
    text's ids are a fresh tokenization's, and most are tokenized from a line start on."""
    rng = random.Random()
    for name, tok in tokenizers_with_line_cuts:
        assert tok.cuts is not None and tok.cuts.lines, name
        with tails_of(tok) as tails:
            for _ in range(6):
                cache = EncodeCache(tok, min_chars=rng.choice([1, 64]))
                doc = _document(rng, rng.randint(40, 120))
                for _ in range(6):
                    ask = rng.choice(["", "\n", " ", "\n\nQuestion: "]) + _document(rng, 2)
                    text = doc + ask.rstrip("\n") if rng.random() < 0.5 else doc + ask
                    got, want = cache(text), tok.encode(text)
                    assert got == want, f"{name}: {first_diff(got, want)}"
                for text in (doc, doc[: rng.randint(1, len(doc))], doc[:5], doc[:1]):  # shorter
                    got, want = cache(text), tok.encode(text)
                    assert got == want, f"{name}: {first_diff(got, want)}"
        # from a line start: the document's ids up to it reused, its last lines and the
        # question tokenized (a question may also cut within the document: then whole)
        assert len(tails) >= 12 and all(len(t) < 2000 for t in tails), name


def test_a_token_across_a_line_start_falls_back_to_a_whole_tokenization():
    """An added token that spans a newline and the letter after it: the line cut would be
    wrong there, and the kept text's own ids (which end otherwise than its part from the cut
    tokenized alone) say so: the text is tokenized whole."""
    from tokenizers import AddedToken

    tok = Tokenizer.byte_level(300, 256, 257)
    tok.cuts  # noqa: B018 (the cuts are of the pipeline before the token is added)
    spanning = "\nQu"
    tok._backend.add_tokens([AddedToken(spanning, normalized=False)])
    rng = random.Random()
    whole = []
    real = tok.cuts.encode
    tok.cuts.encode = lambda text, add_special_tokens=True: (
        add_special_tokens and whole.append(text)) or real(text, add_special_tokens)  # fmt: skip
    try:
        cache = EncodeCache(tok, min_chars=64)
        doc = "".join(f"{words(8, rng)}\nQuestion {i}\n" for i in range(20))
        for i in range(4):
            text = doc + f"{i} {words(3, rng)}"  # parts right after the document
            assert cache(text) == tok.encode(text)
            assert spanning in text[-60:] and tok.encode(text).count(300) == 20
    finally:
        del tok.cuts.encode
    assert len(whole) == 4  # each tokenized whole: no reuse past the token


def test_which_pipelines_offer_line_cuts():
    from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from flashserve.tokenizer.gguf import REGEX_SPLITS

    def lines(pre, norm=None):
        b = Backend(models.WordLevel({"a": 0, "<s>": 1, "[UNK]": 2}, "[UNK]"))
        b.pre_tokenizer, b.normalizer = pre, norm
        b.add_special_tokens([AddedToken("<s>", special=True)])
        return TextCuts.of(b).lines

    known = pre_tokenizers.Split(Regex(REGEX_SPLITS["llama3"]), behavior="isolated")
    plain = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert lines(pre_tokenizers.Sequence([known, plain]))
    assert lines(pre_tokenizers.Sequence([known, plain]), normalizers.NFC())
    assert lines(pre_tokenizers.ByteLevel(add_prefix_space=False))  # GPT-2's regex
    assert lines(pre_tokenizers.Sequence([pre_tokenizers.Digits(True), pre_tokenizers.ByteLevel(
        add_prefix_space=False)]))  # fmt: skip
    assert lines(pre_tokenizers.WhitespaceSplit())
    assert not lines(plain)  # no regex: nothing starts a piece at a line
    assert not lines(pre_tokenizers.ByteLevel(add_prefix_space=True))  # a text's start apart
    assert not lines(pre_tokenizers.Metaspace())
    assert not lines(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\w+|(?<=x)y"), behavior="isolated"), plain]))  # fmt: skip
    assert not lines(
        pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(REGEX_SPLITS["llama3"]), behavior="removed"), plain]
        )
    )
    assert not lines(pre_tokenizers.Sequence([known, plain]), normalizers.Replace("\n", " "))
    assert not lines(None)
