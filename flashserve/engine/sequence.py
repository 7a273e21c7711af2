"""One request's tokens and its progress through the engine."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from flashserve.sampling.params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class FinishReason:
    LENGTH = "length"  # max_new_tokens or the context length reached
    EOS = "eos_token"
    STOP = "stop_sequence"  # a stop string or stop token id
    ABORT = "abort"
    ERROR = "error"  # could not run (e.g. needs more KV blocks than the pool has); see .error


_ids = itertools.count()


class Sequence:
    """A prompt plus the tokens generated so far.

    Two counters drive scheduling: ``num_computed_tokens`` (tokens whose K/V are in the cache)
    and ``num_scheduled_tokens`` (tokens this step will compute). A step that computes up to the
    last token samples a new one. Prefill, chunked prefill, decode and recompute after
    preemption are all the same rule.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        seq_id: int | None = None,
        arrival_time: float | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        self.params = params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_scheduled_tokens = 0
        self.block_table: list[int] = []
        # leading block_table entries whose blocks went back to the pool: every position in
        # them is left of the sliding window of the next token (``BlockManager.release``).
        # Their ids stay, so that entry i still covers positions i*BS .. i*BS+BS-1, but this
        # sequence no longer owns them; attention reads from the window's first block on
        self.num_released_blocks = 0
        # prefix caching: the keys of the full blocks of its tokens so far hashed (a cache,
        # ``BlockManager.keys``), how many leading table entries the block manager has keyed
        # or found keyed, and how many prompt tokens its first admission found cached
        self.block_keys: list[bytes] = []
        self.num_keyed_blocks = 0
        self.num_cached_tokens = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # why, when finish_reason is "error"
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def held_blocks(self) -> list[int]:
        """The blocks this sequence owns: its block table past the released entries."""
        return self.block_table[self.num_released_blocks :]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def samples_this_step(self) -> bool:
        """True when this step computes up to the last token, so a new token is sampled."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table) - self.num_released_blocks})"
        )
