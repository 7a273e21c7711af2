"""Request and response bodies of the text-generation-inference (TGI) API.

Pydantic checks the JSON types (strictly: no "1" for a number); ``to_sampling_params`` applies
the rules of TGI's API with its messages (ranges stricter than the engine's: temperature > 0,
0 < top_p < 1, top_k > 0; truncate, stop sequences per request, unsupported fields), then maps
TGI's parameters onto ``SamplingParams``, which checks the engine's ranges (its errors name the
field; the routes answer them with a 422).
"""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from flashserve.sampling.params import SamplingParams
from server.fields import Text, sent_or

DEFAULT_MAX_NEW_TOKENS = 100  # TGI's router default
MAX_STOP_SEQUENCES = 4  # TGI's --max-stop-sequences default


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class GenerateParameters(_Strict):
    """TGI's ``parameters``; every field is optional. Unknown fields are ignored, as TGI does."""

    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[Text] = Field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False

    @property
    def sampling(self) -> bool:
        """TGI samples when asked to, or when any logits warper is set; otherwise greedy."""
        warped = self.temperature not in (None, 1.0) or self.top_k is not None
        return self.do_sample or warped or self.top_p is not None or self.typical_p is not None


class GenerateRequest(_Strict):
    inputs: Text
    parameters: GenerateParameters = Field(default_factory=GenerateParameters)


class CompatGenerateRequest(GenerateRequest):
    """``POST /``, where TGI's Python client sends its requests: streams when ``stream``."""

    stream: bool = False


def to_sampling_params(p: GenerateParameters) -> SamplingParams:
    """TGI's checks (same messages), then SamplingParams' own; raises ValueError (``InvalidParam``
    for the engine's ranges)."""
    _check_tgi_ranges(p)
    if p.best_of not in (None, 1):
        raise ValueError("`best_of` != 1 is not supported by this server")
    if p.typical_p is not None:
        raise ValueError("`typical_p` is not supported by this server")
    if p.watermark:
        raise ValueError("`watermark` is not supported by this server")
    if p.decoder_input_details:
        raise ValueError(
            "`decoder_input_details` is not supported: prompt logprobs are not computed"
        )
    sampling = p.sampling
    return SamplingParams(
        max_new_tokens=sent_or(p.max_new_tokens, DEFAULT_MAX_NEW_TOKENS),
        temperature=sent_or(p.temperature, 1.0) if sampling else 0.0,
        top_k=sent_or(p.top_k, -1),
        top_p=sent_or(p.top_p, 1.0),
        repetition_penalty=sent_or(p.repetition_penalty, 1.0),
        frequency_penalty=sent_or(p.frequency_penalty, 0.0),
        seed=p.seed,
        stop=p.stop,
    )


def _check_tgi_ranges(p: GenerateParameters) -> None:
    """TGI's own rules: where the engine allows more (temperature 0 is greedy, top_p 1 and
    top_k -1 are off), TGI refuses, and its clients expect these messages."""
    if p.temperature is not None and p.temperature <= 0:
        raise ValueError("`temperature` must be strictly positive")
    if p.top_p is not None and not 0.0 < p.top_p < 1.0:
        raise ValueError("`top_p` must be > 0.0 and < 1.0")
    if p.typical_p is not None and not 0.0 < p.typical_p < 1.0:
        raise ValueError("`typical_p` must be > 0.0 and < 1.0")
    if p.top_k is not None and p.top_k <= 0:
        raise ValueError("`top_k` must be strictly positive")
    if p.truncate is not None and p.truncate <= 0:
        raise ValueError("`truncate` must be strictly positive")
    if len(p.stop) > MAX_STOP_SEQUENCES:
        raise ValueError(
            f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(p.stop)}"
        )


class Token(BaseModel):
    id: int
    text: str
    logprob: float | None
    special: bool


class Details(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    prefill: list[Token] = Field(default_factory=list)
    tokens: list[Token]
    # not TGI's: prompt tokens whose KV came from the prefix cache (TGI clients ignore it)
    cached_tokens: int = 0


class GenerateResponse(BaseModel):
    generated_text: str
    details: Details | None = None

    @model_serializer(mode="wrap")
    def _omit_missing_details(self, handler: SerializerFunctionWrapHandler):
        """TGI leaves ``details`` out (rather than null) unless they were asked for. (No return
        annotation: the OpenAPI schema then shows the model's fields, not a bare object.)"""
        data = handler(self)
        if self.details is None:
            data.pop("details", None)
        return data


class StreamDetails(BaseModel):
    finish_reason: str
    generated_tokens: int
    seed: int | None
    input_length: int
    cached_tokens: int = 0  # not TGI's, as in ``Details``


class StreamResponse(BaseModel):
    index: int
    token: Token | None
    generated_text: str | None = None
    details: StreamDetails | None = None


class Info(BaseModel):
    """TGI's /info, the fields that mean something here."""

    model_id: str
    model_sha: str | None = None
    model_dtype: str
    model_device_type: str
    model_pipeline_tag: str = "text-generation"
    max_batch_size: int  # sequences the engine runs at once (--max-num-seqs)
    max_best_of: int = 1
    max_stop_sequences: int = MAX_STOP_SEQUENCES
    max_input_tokens: int
    max_total_tokens: int
    router: str = "flashserve"
    prefix_caching: bool  # not TGI's: whether computed prompt prefixes are kept and reused
    tensor_parallel_size: int = 1  # not TGI's: the ranks (GPUs) the model is split over
    # not TGI's: the KV cache's dtype (fp8: e4m3 with per-token scales) and its pool's size;
    # under tensor parallelism every rank holds the same tokens (its KV heads of them) and
    # the GiB are one rank's
    kv_cache_dtype: str
    kv_cache_tokens: int
    kv_cache_gib: float
    version: str
    sha: str | None = None
    docker_label: str | None = None
