"""Third-party clients against a real server process: ``text-generation`` (TGI's own Python
client, 0.7.0) on the default model, and schemathesis over the server's OpenAPI schema on
``dummy:tiny``.

``text-generation`` is installed with ``--no-deps`` (docker/install.sh does it for the test
extra; its pin ``huggingface-hub<1.0`` would break transformers), so it is skipped where absent.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_utils import server_process

# text-generation 0.7.0 calls pydantic's deprecated ``.dict()``
pytestmark = pytest.mark.filterwarnings("ignore:The `dict` method is deprecated:DeprecationWarning")
CHATML_PARIS = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


# ---- text-generation (TGI's client) on the default model -----------------------------------


@pytest.fixture(scope="module")
def tgi_url():
    pytest.importorskip("text_generation")
    with server_process("--max-model-len", "512") as base:
        yield base


def test_text_generation_client_generate(tgi_url):
    from text_generation import Client

    out = Client(tgi_url, timeout=120).generate(CHATML_PARIS, max_new_tokens=20)
    assert "Paris" in out.generated_text, out
    details = out.details
    assert details.finish_reason == "eos_token"
    assert details.generated_tokens == len(details.tokens) > 1
    assert details.seed is None and details.prefill == []
    assert details.tokens[-1].special and not any(t.special for t in details.tokens[:-1])
    assert "".join(t.text for t in details.tokens[:-1]) == out.generated_text
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)


def test_text_generation_client_generate_stream(tgi_url):
    from text_generation import Client

    client = Client(tgi_url, timeout=120)
    events = list(client.generate_stream(CHATML_PARIS, max_new_tokens=20))
    assert len(events) > 1
    assert all(e.details is None and e.generated_text is None for e in events[:-1])
    last = events[-1]
    assert last.details.finish_reason == "eos_token"
    assert last.details.generated_tokens == len(events), "one event per token"
    text = "".join(e.token.text for e in events if not e.token.special)
    assert last.generated_text == text and "Paris" in text, text
    assert text == client.generate(CHATML_PARIS, max_new_tokens=20).generated_text


def test_text_generation_async_client_generate(tgi_url):
    from text_generation import AsyncClient

    async def both() -> list:
        client = AsyncClient(tgi_url, timeout=120)
        params = {"max_new_tokens": 20}
        return await asyncio.gather(*(client.generate(CHATML_PARIS, **params) for _ in range(2)))

    first, second = asyncio.run(both())
    assert "Paris" in first.generated_text, first
    assert first.generated_text == second.generated_text, "greedy: the same answer"
    assert first.details.finish_reason == "eos_token"
    assert first.details.generated_tokens == len(first.details.tokens)


def test_text_generation_client_errors_and_sampling(tgi_url):
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(tgi_url, timeout=120)
    with pytest.raises(ValidationError):
        client.generate("hello " * 600, max_new_tokens=5)  # over the context of 512
    params = {"do_sample": True, "temperature": 0.9, "seed": 7, "max_new_tokens": 6}
    first, second = (client.generate("Once upon a time", **params) for _ in range(2))
    assert first.generated_text == second.generated_text and first.details.seed == 7
    assert first.details.finish_reason == "length" and first.details.generated_tokens == 6


# ---- schemathesis over /openapi.json on dummy:tiny -----------------------------------------

OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/info"),
    ("GET", "/metrics"),
    ("POST", "/generate"),
    ("POST", "/generate_stream"),
    ("POST", "/"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]
MAX_EXAMPLES = 25  # per operation and generation mode


@pytest.fixture(scope="module")
def api_schema():
    schemathesis = pytest.importorskip("schemathesis")
    with server_process("--model", "dummy:tiny", "--max-model-len", "256") as base:
        yield schemathesis.openapi.from_url(f"{base}/openapi.json"), base


def test_schema_lists_every_operation(api_schema):
    schema, _ = api_schema
    listed = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# valid requests to every operation; invalid ones where there is an input to get wrong
CASES = [(m, p, "positive") for m, p in OPERATIONS] + [
    (m, p, "negative") for m, p in OPERATIONS if m == "POST"
]


@pytest.mark.parametrize(("method", "path", "mode"), CASES, ids=[" ".join(c) for c in CASES])
def test_responses_conform_to_the_schema(api_schema, method, path, mode):
    """Generated requests, valid and invalid: never a 5xx, and every answer is one the schema
    declares (status, content type, body, headers)."""
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema, base = api_schema
    operation = schema[path][method]
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance, response_headers_conformance]  # fmt: skip
    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=generation))
    def check(case) -> None:
        case.call_and_validate(base_url=base, checks=checks, timeout=60)

    check()


# valid requests that the fuzzer rarely hits (the OpenAI routes check their ranges in code,
# so random bodies there are nearly always 400s): their answers must conform too
VALID = [
    ("POST", "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 3, "details": True,
                                                          "do_sample": True}}),
    ("POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 3, "details": True}}),
    ("POST", "/", {"inputs": "hi", "parameters": {"max_new_tokens": 3}, "stream": True}),
    ("POST", "/v1/completions", {"prompt": ["hi", "yo"], "max_tokens": 3, "n": 2,
                                 "logprobs": 2}),
    ("POST", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
                                 "stream_options": {"include_usage": True}}),
    ("GET", "/v1/models/{model_id}", None),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body"), VALID, ids=[p for _, p, _ in VALID])
def test_valid_answers_conform_to_the_schema(api_schema, method, path, body):
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema, base = api_schema
    operation = schema[path][method]
    if body is None:
        case = operation.Case(path_parameters={"model_id": "dummy:tiny"})
    else:
        case = operation.Case(body=body, media_type="application/json")
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    response = case.call_and_validate(base_url=base, checks=checks, timeout=60)
    assert response.status_code == 200, response.text


def test_body_that_is_not_utf8_is_a_validation_error(api_schema):
    """FastAPI answers an unreadable body with its own 400; it is a 422 ``validation`` on the
    TGI routes (as bad JSON is) and OpenAI's 400 on /v1 (found by schemathesis)."""
    _, base = api_schema
    junk = {"content": b"\xff\xfe{", "headers": {"content-type": "application/json"}}
    r = httpx.post(f"{base}/generate", **junk)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    r = httpx.post(f"{base}/v1/completions", **junk)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
