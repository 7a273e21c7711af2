"""Text <-> token ids for a model, plus its chat template.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust "fast" tokenizer) and the few settings
that live beside it: BOS/EOS ids, whether BOS is added, the chat template. Three sources:

- `from_dir`: a Hugging Face directory (``tokenizer.json`` and its companions);
- `from_gguf`: a GGUF file's metadata (see `flashserve.tokenizer.gguf`);
- `byte_level`: a stand-in for ``dummy:<preset>`` models, one token per byte.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from flashserve.loaders.errors import WeightsError
from flashserve.tokenizer import gguf as gguf_tokenizer
from flashserve.tokenizer.chat_template import render_chat
from flashserve.tokenizer.cuts import TextCuts


class Tokenizer:
    """A model's tokenizer.

    Attributes: ``vocab_size`` (the number of ids), ``bos_token_id``,
    ``eos_token_ids`` (every id that ends generation), ``chat_template``, ``all_special_ids``,
    ``max_token_chars`` (the most characters of text one token stands for; None: no bound).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: list[int] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        vocab_size: int | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        """``add_bos_token``/``add_eos_token``: when either is given (or ``backend`` has no
        post-processor), `encode` adds exactly what they ask for; when both are None,
        ``backend``'s own post-processor decides, as ``tokenizer.json`` says.

        ``special_tokens`` maps template variable names (``bos_token``...) to token strings.
        """
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids or []))
        self.chat_template = chat_template or None
        self.vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._special_tokens = dict(special_tokens or {})
        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            backend.post_processor = self._post_processor(bool(add_bos_token), bool(add_eos_token))
        self._register_special([bos_token_id, *self.eos_token_ids])
        added = backend.get_added_tokens_decoder()
        self.all_special_ids = {i for i, tok in added.items() if tok.special}
        self.max_token_chars = _max_token_chars(backend)  # ~50 ms for a 50K vocabulary

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face model directory: ``tokenizer.json`` plus, when present,
        ``tokenizer_config.json``, ``chat_template.jinja``, ``special_tokens_map.json`` and
        ``generation_config.json`` (whose ``eos_token_id`` may be a list)."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (the fast tokenizer file)")
        backend = _read_backend(path / "tokenizer.json")
        config = _read_json(path / "special_tokens_map.json")
        config.update(_read_json(path / "tokenizer_config.json"))
        names = {k: _token_text(config.get(k)) for k in _SPECIAL_NAMES}
        bos, eos = (_token_id(backend, names[k]) for k in ("bos_token", "eos_token"))
        # generation_config.json's EOS ids (end of turn too), then the tokenizer's EOS token
        eos = _eos_ids(_read_json(path / "generation_config.json").get("eos_token_id")) + [eos]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[i for i in eos if i is not None],
            add_bos_token=config.get("add_bos_token"),
            add_eos_token=config.get("add_eos_token"),
            chat_template=_dir_chat_template(path, config),
            special_tokens=names,
        )

    @classmethod
    def from_gguf(cls, source: str | os.PathLike | Any) -> Tokenizer:
        """From a GGUF file's metadata; ``source`` is a path, a ``gguf.GGUFReader`` or a
        ``{key: value}`` metadata mapping."""
        meta = gguf_tokenizer.read_metadata(source)
        get = lambda key: meta.get(f"tokenizer.ggml.{key}")
        eos = [get(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        add_bos = get("add_bos_token")
        if add_bos is None:  # llama.cpp adds BOS to SentencePiece vocabularies by default
            add_bos = get("model") == "llama"
        return cls(
            gguf_tokenizer.build_backend(meta),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=[int(i) for i in eos if i is not None],
            add_bos_token=bool(add_bos),
            add_eos_token=bool(get("add_eos_token")),
            chat_template=meta.get("tokenizer.chat_template"),
            vocab_size=len(get("tokens")),
            special_tokens=_gguf_special_tokens(meta),
        )

    @classmethod
    def byte_level(
        cls,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_id: int,
        add_bos_token: bool = False,
    ) -> Tokenizer:
        """One token per byte, plus BOS and EOS, for models with random weights.

        The 256 byte tokens take the lowest ids that BOS and EOS leave free. Every other id
        below ``vocab_size`` decodes to a visible placeholder ``<|id|>``, so a random model's
        output reads as text; no text encodes to a placeholder.
        """
        specials = {i: name for i, name in ((bos_token_id, "<|bos|>"), (eos_token_id, "<|eos|>"))
                    if i is not None}  # fmt: skip
        if not all(0 <= i < vocab_size for i in specials) or vocab_size < 256 + len(specials):
            raise ValueError(f"byte-level tokenizer: bad ids {specials} for vocab {vocab_size}")
        free = (i for i in range(vocab_size) if i not in specials)
        alphabet = gguf_tokenizer.byte_alphabet()
        vocab = {alphabet[b]: next(free) for b in range(256)}
        vocab.update({f"<|{i}|>": i for i in free})  # the ids the bytes left
        vocab.update({name: i for i, name in specials.items()})
        backend = Backend(models.BPE(vocab, []))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True) for t in specials.values()])
        names = {"bos_token": specials.get(bos_token_id), "eos_token": specials[eos_token_id]}
        return cls(backend, bos_token_id=bos_token_id, eos_token_ids=[eos_token_id],
                   add_bos_token=add_bos_token, vocab_size=vocab_size,
                   special_tokens=names)  # fmt: skip

    # ---- text <-> ids --------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it (``<|im_start|>``) stay whole.
        ``add_special_tokens`` adds BOS/EOS where the model's configuration asks for them.

        Other Python threads run meanwhile: ``encode_batch`` lets go of the GIL, ``encode``
        holds it throughout (17 s for 8 MB on a byte-level vocabulary, during which a server's
        event loop on another thread could not answer anything)."""
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @functools.cached_property
    def cuts(self) -> TextCuts | None:
        """Where a text's tokenization can be cut and reused within a longer text (before a
        special token: ``flashserve.tokenizer.cuts``), or None for a pipeline not known to
        allow it."""
        return TextCuts.of(self._backend)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text``, without tokenizing it: no token
        stands for more than ``max_token_chars`` characters (0 when there is no such bound)."""
        if self.max_token_chars is None:
            return 0
        return -(-len(text) // self.max_token_chars)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; bytes that do not form UTF-8 characters become U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as spelled there (``Ġthe``, ``▁the``, ``<|im_end|>``)."""
        return [self._backend.id_to_token(int(i)) or "" for i in ids]

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a special token (BOS, EOS, control tokens)."""
        return token_id in self.all_special_ids

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for a conversation, rendered by the model's chat template.

        ``kwargs`` become extra template variables (``tools``, ``documents``...). Raises
        ValueError when there is no template or the messages are malformed.
        """
        variables = {k: v for k, v in self._special_tokens.items() if v is not None}
        variables.update(kwargs)
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **variables
        )

    def _register_special(self, ids: list[int | None]) -> None:
        """Make BOS/EOS special tokens of the backend (as Hugging Face does), so that
        ``all_special_ids`` is exactly what ``decode(skip_special_tokens=True)`` drops."""
        added = self._backend.get_added_tokens_decoder()
        names = [self._backend.id_to_token(i) for i in ids if i is not None and i not in added]
        new = [AddedToken(t, special=True, normalized=False) for t in names if t is not None]
        self._backend.add_special_tokens(new)

    def _post_processor(self, add_bos: bool, add_eos: bool) -> processors.TemplateProcessing:
        """Adds BOS before the text and EOS (the first EOS id) after it, as asked."""
        front = [self.bos_token_id] if add_bos and self.bos_token_id is not None else []
        back = self.eos_token_ids[:1] if add_eos else []
        name = self._backend.id_to_token
        parts = [name(i) for i in front] + ["$A"] + [name(i) for i in back]
        specials = [(name(i), i) for i in set(front + back)]
        return processors.TemplateProcessing(single=" ".join(parts), special_tokens=specials)


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_GGUF_SPECIAL_KEYS = {
    "bos_token": "bos",
    "eos_token": "eos",
    "unk_token": "unknown",
    "pad_token": "padding",
}


def _gguf_special_tokens(meta: dict[str, Any]) -> dict[str, str | None]:
    """Template variables ``bos_token``... from a GGUF's special token ids."""
    tokens = meta["tokenizer.ggml.tokens"]
    ids = {k: meta.get(f"tokenizer.ggml.{v}_token_id") for k, v in _GGUF_SPECIAL_KEYS.items()}
    return {k: tokens[i] if i is not None else None for k, i in ids.items()}


def _max_token_chars(backend: Backend) -> int | None:
    """The most characters of text one token can stand for, or None when a run of unknown
    characters may become one token (a fused unknown token, Unigram's): then there is no bound.

    A vocabulary entry is at least as long as the text it stands for: byte-level entries spell
    each byte as one character (a character is one to four bytes), SentencePiece's ``▁`` is one
    space, byte-fallback entries (``<0xE2>``) stand for one byte. A normalizer may shrink the
    text first: NFC/NFKC compose up to 4 code points into one character (Unicode's longest
    canonical decomposition), hence the factor 4. Characters a normalizer deletes outright are
    not covered: a prompt made mostly of them is not one a client means to send.
    """
    longest = max(map(len, backend.get_vocab(with_added_tokens=True)), default=1)
    model = backend.model
    if isinstance(model, models.WordPiece):  # an unknown word becomes one [UNK]
        longest = max(longest, model.max_input_chars_per_word)
    elif isinstance(model, models.Unigram) or (
        isinstance(model, models.BPE) and model.fuse_unk and not model.byte_fallback
    ):
        return None
    return longest * 4 if backend.normalizer is not None else longest


def _read_backend(file: Path) -> Backend:
    """``tokenizer.json`` as the tokenizers library reads it. What it cannot read (a file cut
    short, overwritten, or in a newer library's format) is a WeightsError naming the file: the
    library raises a bare Exception, which the command line would print as a traceback."""
    try:
        return Backend.from_file(str(file))
    except Exception as exc:  # the library's only exception type
        problem = f"unreadable by tokenizers {tokenizers.__version__}: {exc}"
        raise WeightsError(file, f"{problem} (cut short, or from a newer version?)") from exc


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents, {} if there is no such file; WeightsError naming it if
    it holds something else."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(path, f"corrupt: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise WeightsError(path, "corrupt: not a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as written in a config: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def _token_id(backend: Backend, token: str | None) -> int | None:
    return backend.token_to_id(token) if token else None


def _eos_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dir_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` if present, else the config's template (a string, or a list of
    named templates: the one named ``default``)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template
