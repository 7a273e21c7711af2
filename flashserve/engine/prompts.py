"""A prompt's checks before it joins the engine: tokenized, its ids valid, its length within the
context. ``LLMEngine.make_request`` runs them in process; the engine core's client runs them in
the HTTP front end, which sends the core only ids that passed."""

from __future__ import annotations

from flashserve.sampling.params import SamplingParams
from flashserve.tokenizer.encode_cache import EncodeCache
from flashserve.tokenizer.tokenizer import Tokenizer


class PromptChecker:
    """Checks prompts against a model: its tokenizer, its ``vocab_size`` embedding rows and the
    context length ``max_model_len``. Every method raises ValueError naming the problem. Text
    prompts are tokenized through an ``EncodeCache``, so a long prompt sent again is not
    tokenized again."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.encode = EncodeCache(tokenizer)

    def checked_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, once they and ``params.max_new_tokens`` fit the context."""
        ids = self.token_ids(prompt)
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens and max_new_tokens is "
                f"{params.max_new_tokens}: together {total}, over the context length of "
                f"{self.max_model_len} tokens"
            )
        return ids

    def check_text_fits(self, text: str) -> None:
        """Raise ValueError if ``text`` has more tokens than the context holds, judged from its
        length alone (no token stands for more than ``max_token_chars`` characters): cheap
        enough to run before admission, where tokenizing megabytes would take seconds."""
        least = self.tokenizer.min_tokens(text)
        if least > self.max_model_len:
            raise ValueError(
                f"the prompt has at least {least} tokens ({len(text)} characters), over "
                f"the context length of {self.max_model_len} tokens"
            )

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        """The prompt's token ids; text longer than the context could hold is refused before
        it is tokenized (which, for megabytes, takes seconds)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt must not be empty")
            self.check_text_fits(prompt)
            ids = self.encode(prompt)
            # a tokenizer whose added tokens pass the model's embedding rows would make the
            # device index out of bounds (on CUDA, an assert that ends the process)
            if ids and max(ids) >= self.vocab_size:
                raise ValueError(f"the tokenizer gave id {max(ids)}, which the model's "
                                 f"{self.vocab_size} embeddings lack")  # fmt: skip
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            # the common case checked at C speed (a 128K-token prompt: 2 ms, not 10); bool is
            # not an id (``type(True) is bool``)
            plain = all(type(t) is int for t in ids)
            if not (plain and ids and 0 <= min(ids) and max(ids) < vocab):
                bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)
                       or not 0 <= t < vocab]  # fmt: skip
                if bad:
                    raise ValueError(f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        if not ids:
            raise ValueError("the prompt must not be empty")
        return ids
