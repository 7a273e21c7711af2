"""One validation of sampling ranges: ``SamplingParams``. The routes keep only their dialect's
own rules (TGI's stricter ranges and messages; OpenAI's choices, stop count, unsupported
fields) and answer the engine's ``InvalidParam`` in their shape, naming their own field. The
HTTP answers themselves (status, body shape) are tests/test_bad_input.py's."""

from __future__ import annotations

import pytest

from flashserve.sampling.params import InvalidParam, SamplingParams
from server.openai_schemas import ChatRequest, CompletionRequest, ParamError
from server.schemas import GenerateParameters, to_sampling_params

HI = [{"role": "user", "content": "hi"}]
# (engine field, OpenAI field, bad value): each out of the engine's range
OUT_OF_RANGE = [
    ("temperature", "temperature", -1.0),
    ("temperature", "temperature", float("nan")),
    ("temperature", "temperature", 1e39),  # inf in float32
    ("top_p", "top_p", 0.0),
    ("top_p", "top_p", 1.5),
    ("top_k", "top_k", -5),
    ("min_p", "min_p", 2.0),
    ("presence_penalty", "presence_penalty", 3.0),
    ("frequency_penalty", "frequency_penalty", float("inf")),
    ("repetition_penalty", "repetition_penalty", 0.0),
    ("seed", "seed", -1),
    ("seed", "seed", 2**63),
    ("stop", "stop", ["ok", ""]),
    ("max_new_tokens", "max_tokens", 0),
    ("max_new_tokens", "max_tokens", 2**40),
    ("logprobs", "logprobs", 21),
]


def _engine_error(field: str, value) -> InvalidParam:
    with pytest.raises(InvalidParam) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field
    return err.value


@pytest.mark.parametrize(("field", "openai_field", "value"), OUT_OF_RANGE)
def test_openai_refuses_what_sampling_params_refuses_in_its_words(field, openai_field, value):
    """The same message as the engine's (one check, not a copy of it), about the request's
    field."""
    want = str(_engine_error(field, value)).replace(field, openai_field, 1)
    body = CompletionRequest(prompt="hi", **{openai_field: value})
    with pytest.raises(ParamError) as err:
        body.check()
    assert (err.value.param, str(err.value)) == (openai_field, want)


@pytest.mark.parametrize(
    ("sent", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"max_tokens": 5, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"temperature": -0.5}, "temperature"),
    ],
)
def test_chat_names_its_own_fields(sent, param):
    with pytest.raises(ParamError) as err:
        ChatRequest(messages=HI, **sent).check()
    assert err.value.param == param and str(err.value).startswith(param)


def test_openai_dialect_rules_stay():
    for body, param in [
        (CompletionRequest(prompt="hi", n=17), "n"),
        (CompletionRequest(prompt="hi", stop=[f"s{i}" for i in range(17)]), "stop"),
        (CompletionRequest(prompt="hi", logit_bias={"1": 2.0}), "logit_bias"),
        (ChatRequest(messages=HI, top_logprobs=2), "top_logprobs"),
    ]:
        with pytest.raises(ParamError) as err:
            body.check()
        assert err.value.param == param


def test_a_seed_at_the_top_wraps_for_later_choices():
    body = CompletionRequest(prompt="hi", seed=2**63 - 1, n=3)
    body.check()
    assert [body.sampling_params(4, None, j).seed for j in range(3)] == [2**63 - 1, 0, 1]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", float("nan")),
        ("max_new_tokens", 0),
        ("seed", -1),
    ],
)
def test_tgi_refuses_the_engine_ranges_with_the_engine_error(field, value):
    with pytest.raises(InvalidParam) as err:
        to_sampling_params(GenerateParameters(do_sample=True, **{field: value}))
    assert str(err.value) == str(_engine_error(field, value))


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        ({"temperature": 0.0}, "`temperature` must be strictly positive"),
        ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
        ({"top_k": -1}, "`top_k` must be strictly positive"),
        ({"truncate": 0}, "`truncate` must be strictly positive"),
        ({"stop": list("abcde")}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ],
)
def test_tgi_keeps_its_stricter_ranges_and_messages(sent, message):
    """Values the engine would take (temperature 0 is greedy, top_p 1 and top_k -1 are off)
    that TGI's API refuses, with its messages."""
    with pytest.raises(ValueError) as err:
        to_sampling_params(GenerateParameters(**sent))
    assert str(err.value) == message and not isinstance(err.value, InvalidParam)
