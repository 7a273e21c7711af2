"""Request and response bodies of the OpenAI API (``/v1/completions``, ``/v1/chat/completions``).

Pydantic checks the JSON types strictly (no "1" for a number); ``check`` applies the rules of
OpenAI's API (choices, stop strings per request, unsupported fields) and then the engine's
ranges, which ``SamplingParams`` alone checks: ``sampling_params`` maps the request onto it and
turns its ``InvalidParam`` into a ``ParamError`` that names the request's field (``max_tokens``
for the engine's ``max_new_tokens``), for the error body's ``param``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashserve.sampling.params import InvalidParam, SamplingParams
from server.fields import Text, UnicodeChecked, sent_or, unicode_text

MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
SEED_MOD = 2**63  # seeds are 63-bit; choice i samples with (seed + i) % SEED_MOD


class ParamError(ValueError):
    """A request value the server cannot serve; ``param`` names it."""

    def __init__(self, param: str | None, message: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """What both routes share. Unknown fields are ignored, as OpenAI does; ``top_k``,
    ``min_p``, ``repetition_penalty`` and ``ignore_eos`` are extras (as vLLM's)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Annotated[str | list[str] | None, UnicodeChecked] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False

    def check_common(self, max_tokens: int | None, logprobs: int | None) -> None:
        """OpenAI's own rules, then the engine's ranges: the parameters of this request's first
        choice are built once (``max_tokens`` None: the context decides later; 1 stands in)."""
        if not 1 <= self.n <= MAX_N:
            raise ParamError("n", f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.logit_bias:
            raise ParamError("logit_bias", "logit_bias is not supported by this server")
        stops = self.stop_list
        if len(stops) > MAX_STOP:
            raise ParamError("stop", f"stop takes at most {MAX_STOP} strings, got {len(stops)}")
        self.sampling_params(sent_or(max_tokens, 1), logprobs, 0)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def field_names(self) -> dict[str, str]:
        """This request's field for each engine parameter whose name differs."""
        return {"max_new_tokens": "max_tokens"}

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """The engine's parameters for choice ``choice`` (its seed is ``seed + choice``); a value
        out of the engine's range is a ``ParamError`` naming this request's field."""
        try:
            return SamplingParams(
                max_new_tokens=max_tokens,
                temperature=sent_or(self.temperature, 1.0),
                top_k=sent_or(self.top_k, -1),
                top_p=sent_or(self.top_p, 1.0),
                min_p=sent_or(self.min_p, 0.0),
                presence_penalty=sent_or(self.presence_penalty, 0.0),
                frequency_penalty=sent_or(self.frequency_penalty, 0.0),
                repetition_penalty=sent_or(self.repetition_penalty, 1.0),
                seed=_choice_seed(self.seed, choice),
                stop=self.stop_list,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
            )
        except InvalidParam as exc:
            raise _renamed(exc, self.field_names()) from exc


def _choice_seed(seed: int | None, choice: int) -> int | None:
    """Choice i samples with ``(seed + i) % SEED_MOD``; a seed outside [0, SEED_MOD) goes as
    it was sent, for ``SamplingParams`` to refuse."""
    if seed is None or not 0 <= seed < SEED_MOD:
        return seed
    return (seed + choice) % SEED_MOD


def _renamed(exc: InvalidParam, names: dict[str, str]) -> ParamError:
    """The engine's error about one of its fields, about the request's field instead."""
    name, message = names.get(exc.param, exc.param), str(exc)
    if message.startswith(exc.param):
        message = name + message[len(exc.param) :]
    return ParamError(name, message)


# ---- /v1/completions ---------------------------------------------------------------------------


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingRequest):
    prompt: Any  # checked by _prompt_shape: pydantic's union errors are unreadable
    max_tokens: int | None = DEFAULT_COMPLETION_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Prompt:
        if isinstance(value, str) or _is_ids(value):
            return unicode_text(value)
        if isinstance(value, list) and (
            all(isinstance(p, str) for p in value) or all(_is_ids(p) for p in value)
        ):
            return unicode_text(value)
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids"
        )

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request; raises ParamError when any is empty."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts or any(len(x) == 0 for x in prompts):
            raise ParamError("prompt", "prompt must not be empty")
        return prompts

    def check(self) -> None:
        self.check_common(sent_or(self.max_tokens, DEFAULT_COMPLETION_TOKENS), self.logprobs)
        if self.best_of not in (None, 1):
            raise ParamError("best_of", "best_of > 1 is not supported by this server")
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported by this server")
        if self.echo and self.logprobs is not None:
            raise ParamError("echo", "echo with logprobs is not supported: no prompt logprobs")


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


# ---- /v1/chat/completions ----------------------------------------------------------------------


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart], UnicodeChecked]
    name: Text | None = None
    tool_call_id: Text | None = None

    def for_template(self) -> dict[str, str]:
        """The message as chat templates expect it: text content; ``developer`` (OpenAI's
        newer name for ``system``) becomes ``system``."""
        content = self.content
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        msg = {"role": "system" if self.role == "developer" else self.role, "content": content}
        msg.update({k: v for k in ("name", "tool_call_id") if (v := getattr(self, k))})
        return msg


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return sent_or(self.max_completion_tokens, self.max_tokens)

    def check(self) -> None:
        if not self.messages:
            raise ParamError("messages", "messages must not be empty")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.tools:
            raise ParamError("tools", "tools are not supported by this server")
        self.check_common(self.max_new_tokens, self.engine_logprobs)

    def field_names(self) -> dict[str, str]:
        sent = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return {"max_new_tokens": sent, "logprobs": "top_logprobs"}

    @property
    def engine_logprobs(self) -> int | None:
        return sent_or(self.top_logprobs, 0) if self.logprobs else None


# ---- responses ---------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (not computed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role", "content"} first, then {"content"}, and {} at the end
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "flashserve"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
