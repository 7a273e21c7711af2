"""What crosses between the HTTP front end and the engine core process, and its encoding.

Front end -> core: ``AddRequest`` (token ids and sampling parameters: the front end has
tokenized and checked the prompt), ``Abort``, ``Fail`` and ``Shutdown``. Core -> front end:
one ``StepMessage`` per engine step, holding every request's new outputs of that step and a
``EngineStats`` snapshot (the same message, with no outputs, goes out every
``STATS_PERIOD_S`` while the core is idle: its heartbeat).

Encoded with msgspec's MessagePack (array-like structs: no field names on the wire), sent over
ZeroMQ: docs/benchmarks/ipc.md has the measurement behind that choice. Nothing grows with the
request per token: an output carries the text its tokens added, not the whole text so far
(only the final one carries the whole text, which a stop string may have cut), and never the
prompt's ids.
"""

from __future__ import annotations

import msgspec

from flashserve.engine.outputs import RequestOutput, TokenOutput
from flashserve.sampling.params import SamplingParams

# seconds between two stats snapshots of an idle core: the front end's heartbeat and the
# /metrics gauges are at most this old while nothing runs
STATS_PERIOD_S = 0.5


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Fail(msgspec.Struct, tag="fail", array_like=True):
    """End every open request, and every later one, with ``error`` (the shutdown cut)."""

    error: str


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToCore = AddRequest | Abort | Fail | Shutdown


class WireToken(msgspec.Struct, array_like=True, gc=False):
    id: int
    text: str
    logprob: float
    special: bool
    top_logprobs: list[tuple[int, str, float]] | None = None


class WireOutput(msgspec.Struct, array_like=True, gc=False):
    """A ``RequestOutput`` less what the front end knows (the prompt): ``text`` is what this
    output adds to the generated text, or, once ``finished``, the whole generated text."""

    request_id: str
    tokens: list[WireToken]
    finished: bool
    finish_reason: str | None
    text: str
    num_generated_tokens: int
    seed: int | None
    error: str | None
    held_back: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache


class EngineStats(msgspec.Struct, array_like=True, gc=False):
    """The engine's gauges at one moment, as the core publishes them.

    ``time``: the core's ``time.monotonic()`` when it took them (its heartbeat; Linux's
    CLOCK_MONOTONIC is one clock for every process). ``gpu_memory``: (allocated, reserved)
    bytes of torch's caching allocator on the engine's device; None on a CPU.
    ``prefix_cache_queries`` / ``prefix_cache_hits``: counters since start, in tokens, of what
    admitted sequences looked up in the prefix cache and found there (0 with caching off)."""

    time: float
    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    unfinished: int  # requests the engine holds (running, waiting, or between the two)
    gpu_memory: tuple[int, int] | None = None
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class StepMessage(msgspec.Struct, array_like=True, gc=False):
    outputs: list[WireOutput]
    stats: EngineStats


def to_wire(out: RequestOutput, sent_chars: int) -> WireOutput:
    """``out`` for the wire; ``sent_chars``: characters of its generated text already sent."""
    text = out.generated_text if out.finished else out.generated_text[sent_chars:]
    tokens = [WireToken(t.id, t.text, t.logprob, t.special, t.top_logprobs)
              for t in out.new_tokens]  # fmt: skip
    return WireOutput(out.request_id, tokens, out.finished, out.finish_reason, text,
                      out.num_generated_tokens, out.seed, out.error, out.held_back,
                      out.num_cached_tokens)  # fmt: skip


def from_wire(w: WireOutput, text: str, prompt_token_ids: list[int]) -> RequestOutput:
    """The ``RequestOutput`` of ``w``; ``text``: the whole generated text so far."""
    tokens = [TokenOutput(t.id, t.text, t.logprob, t.special, t.top_logprobs) for t in w.tokens]
    return RequestOutput(
        request_id=w.request_id,
        new_tokens=tokens,
        finished=w.finished,
        finish_reason=w.finish_reason,
        generated_text=text,
        num_prompt_tokens=len(prompt_token_ids),
        num_generated_tokens=w.num_generated_tokens,
        seed=w.seed,
        prompt_token_ids=prompt_token_ids,
        error=w.error,
        held_back=w.held_back,
        num_cached_tokens=w.num_cached_tokens,
    )


class Codec:
    """msgspec encoder and typed decoders, reused: building them per message costs more than
    the message itself."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.step = msgspec.msgpack.Decoder(StepMessage)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self.encoder.encode(message)
