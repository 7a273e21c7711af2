"""Per-request sampling and stopping parameters, validated on construction.

Floats are checked as the device will see them: the sampler computes in float32, where 1e-46
is 0.0 and 1e39 is infinity, so a value that passes as a Python float can still be out of range
there. Each error is an ``InvalidParam`` naming its field (``param``), which the HTTP routes map
onto their own error shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_TOKENS_LIMIT = 2**31 - 1
MAX_LOGPROBS = 20
# Temperatures below this sample greedily: dividing by them can overflow float32 (1e2 / 1e-37 is
# inf), and at 1e-5 a logit gap of 1e-3 is already a factor e**100 between probabilities.
MIN_TEMPERATURE = 1e-5
FLOAT32_MAX = float(np.finfo(np.float32).max)  # 3.4e38
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 1.2e-38, the smallest normal


class InvalidParam(ValueError):
    """A sampling value the engine cannot serve; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 (anything below ``MIN_TEMPERATURE``) means greedy. top_k <= 0 (or -1) turns
    top-k off; top_p 1.0 and min_p 0.0 are off. ``seed`` makes sampling reproducible whatever
    else is in the batch; None draws one. ``logprobs`` asks for the top-N alternatives of each
    generated token (the chosen token's log-probability is always computed).
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_TOKENS_LIMIT)
        _check_float("temperature", self.temperature, 0.0, FLOAT32_MAX)
        _check_int("top_k", self.top_k, -1, MAX_TOKENS_LIMIT)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        # a factor that divides or multiplies logits: zero and subnormal float32 values would
        # turn them into inf or 0 (float32's smallest normal is 1.2e-38)
        _check_float("repetition_penalty", self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParam("stop", "stop strings must be non-empty strings")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, 0, MAX_TOKENS_LIMIT)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        """The one rule for a greedy row: its token is the argmax of its (penalised) logits."""
        return self.temperature < MIN_TEMPERATURE


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParam(name, f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidParam(name, f"{name} must be in [{lo}, {hi}], got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, low_open: bool = False) -> None:
    """``value`` must be a finite number in [lo, hi] ((lo, hi] with ``low_open``), both as
    given and once rounded to float32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParam(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidParam(name, f"{name} must be finite, got {value}")
    as32 = _as_float32(value)
    for v in (value, as32):
        if v < lo or v > hi or (low_open and v == lo):
            bracket = "(" if low_open else "["
            where = "" if v == value else f" ({as32!r} in float32, as the sampler sees it)"
            raise InvalidParam(name, f"{name} must be in {bracket}{lo:g}, {hi:g}], got "
                                     f"{value!r}{where}")  # fmt: skip


def _as_float32(value: float) -> float:
    """``value`` rounded to float32: inf past its largest value, 0 below its smallest."""
    if abs(value) > FLOAT32_MAX:
        return math.copysign(math.inf, value)
    return float(np.float32(value))
