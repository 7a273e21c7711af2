"""What the engine hands back to its callers, per step and per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenOutput:
    """One generated token as a client sees it."""

    id: int
    text: str  # the text this token adds to the output (may be "" while a character is split)
    logprob: float
    special: bool
    top_logprobs: list[tuple[int, str, float]] | None = None  # (id, text, logprob), best first


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; the final one has ``finished`` set."""

    request_id: str
    new_tokens: list[TokenOutput]
    finished: bool
    finish_reason: str | None = None  # "length", "eos_token", "stop_sequence", "abort", "error"
    generated_text: str = ""  # the whole output so far (stop string removed once finished)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    seed: int | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # set with finish_reason "error"
    # trailing characters of generated_text that could still begin a stop string (0 once
    # finished): a stream holds them back until a later output tells
    held_back: int = 0
    # prompt tokens whose KV came from the prefix cache at the request's admission (not
    # computed); 0 until it is admitted
    num_cached_tokens: int = 0


@dataclass
class Completion:
    """A finished request, as the synchronous ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float]
    seed: int | None = None
