"""The OpenAI API end to end, through the official ``openai`` client: a real server process on
the default model (SmolLM2-135M-Instruct on CPU), plus an in-process server on ``dummy:tiny``
for a client that disconnects."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from server_utils import server_process, server_thread, sse_events

from flashserve.config import EngineConfig
from flashserve.engine.async_llm import AsyncLLM
from flashserve.loaders.load import default_model_path
from flashserve.tokenizer.tokenizer import Tokenizer
from server.app import build_app

openai = pytest.importorskip("openai")  # in the test extra; absent on the GPU machine

MAX_MODEL_LEN = 512
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url():
    with server_process("--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_gguf(default_model_path())


def _chat(oai, model, **kwargs):
    return oai.chat.completions.create(model=model, messages=PARIS, **kwargs)


def _streamed(stream) -> tuple[list[str], list, object]:
    """Each choice's text deltas joined, the finish reasons and the usage of a stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return [texts[i] for i in sorted(texts)], [reasons[i] for i in sorted(reasons)], usage


# ---- the routes --------------------------------------------------------------------------------


def test_models(oai, http, model):
    [card] = oai.models.list().data
    assert card.id.startswith("SmolLM2-135M-Instruct") and card.object == "model"
    assert oai.models.retrieve(model).id == model
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text


def test_chat_greedy_answers_paris_with_usage(oai, model, tok):
    out = _chat(oai, model, temperature=0, max_tokens=30, logprobs=True, top_logprobs=3)
    [choice] = out.choices
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    prompt = tok.encode(tok.apply_chat_template(PARIS))
    assert out.usage.prompt_tokens == len(prompt)
    content = choice.logprobs.content
    assert out.usage.completion_tokens == len(content) + 1, "the EOS token counts, unseen"
    assert out.usage.total_tokens == len(prompt) + out.usage.completion_tokens
    assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob


def test_chat_stream_matches_and_counts(oai, model):
    whole = _chat(oai, model, temperature=0, max_tokens=30)
    stream = _chat(
        oai, model, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, reasons, usage = _streamed(stream)
    assert texts == [whole.choices[0].message.content] and reasons == ["stop"]
    # the same counts; the stream may find in the prefix cache what ``whole`` computed
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= whole.usage.prompt_tokens_details.cached_tokens
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"}
    )


def test_chat_text_parts_and_developer_role(oai, model, tok):
    """Content as a list of text parts reads as its text; ``developer`` is ``system``."""
    system = "You are a geography teacher."
    plain = [{"role": "system", "content": system}, *PARIS]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": system}]},
        {"role": "user", "content": [{"type": "text", "text": PARIS[0]["content"]}]},
    ]
    a = oai.chat.completions.create(model=model, messages=plain, temperature=0, max_tokens=8)
    b = oai.chat.completions.create(model=model, messages=parts, temperature=0, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == len(tok.encode(tok.apply_chat_template(plain)))


def test_completions_length_usage_and_stream(oai, model, tok):
    prompt = "Once upon a time"
    out = oai.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    [choice] = out.choices
    assert out.object == "text_completion" and choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(tok.encode(prompt))
    assert out.usage.completion_tokens == 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5
    stream = oai.completions.create(
        model=model, prompt=prompt, max_tokens=5, temperature=0, stream=True
    )
    assert _streamed(stream)[:2] == ([choice.text], ["length"])


def test_completions_many_prompts_token_ids_and_echo(oai, model, tok):
    ids = tok.encode("The sky is")
    out = oai.completions.create(
        model=model, prompt=["Once upon a time", "The sky is"], max_tokens=3, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1]
    by_ids = oai.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert by_ids.choices[0].text == out.choices[1].text
    assert by_ids.usage.prompt_tokens == len(ids)
    echo = oai.completions.create(model=model, prompt="The sky is", max_tokens=3, temperature=0,
                                  echo=True)  # fmt: skip
    assert echo.choices[0].text == "The sky is" + out.choices[1].text


def test_n_with_seed(oai, model):
    kwargs = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    two = oai.completions.create(n=2, seed=7, **kwargs)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.usage.completion_tokens == 16
    again = oai.completions.create(n=2, seed=7, **kwargs)
    assert [c.text for c in again.choices] == [c.text for c in two.choices]
    second = oai.completions.create(n=1, seed=8, **kwargs)
    assert second.choices[0].text == two.choices[1].text, "choice i samples with seed + i"
    stream = oai.completions.create(n=2, seed=7, stream=True, **kwargs)
    assert _streamed(stream)[0] == [c.text for c in two.choices]
    chat = _chat(oai, model, n=2, seed=3, max_tokens=6)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 12


@pytest.mark.parametrize("stop", [" Paris.", "Paris", ["xyz", " Paris!"]])
def test_stop_strings_never_reach_the_client(oai, model, stop):
    """The stop " Paris." spans two tokens, so streaming must hold " Paris" back until "."
    decides; " Paris!" never completes, so the held text comes out in the end."""
    whole = _chat(oai, model, temperature=0, max_tokens=30, stop=stop)
    text = whole.choices[0].message.content
    stream = _chat(oai, model, temperature=0, max_tokens=30, stop=stop, stream=True)
    assert _streamed(stream)[0] == [text]
    if stop == ["xyz", " Paris!"]:
        assert "Paris." in text
    else:
        assert text.startswith("The capital of France is") and "Paris" not in text
        assert whole.choices[0].finish_reason == "stop"


def test_completion_logprobs(oai, model):
    out = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=4,
                                 temperature=0, logprobs=2)  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for t, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) >= 2 and top[t] == pytest.approx(value)


def test_client_raises_bad_request(oai, model):
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=model, prompt="hi", temperature=-1)
    assert err.value.status_code == 400 and err.value.body["param"] == "temperature"


# ---- bad input: 400 in OpenAI's shape, then the server still serves -----------------------------

LONG = "hello " * (MAX_MODEL_LEN + 10)
IMAGE = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
COMPLETIONS_INVALID = {
    "bad json": '{"prompt": "hi",',
    "not an object": '["hi"]',
    "missing prompt": {"max_tokens": 2},
    "empty prompt": {"prompt": ""},
    "empty prompt list": {"prompt": []},
    "empty prompt in list": {"prompt": ["hi", ""]},
    "empty token list in list": {"prompt": [[1, 2], []]},
    "prompt a number": {"prompt": 5},
    "prompt of floats": {"prompt": [1.5, 2]},
    "token id out of vocab": {"prompt": [10**9]},
    "temperature -1": {"prompt": "hi", "temperature": -1},
    "temperature a string": {"prompt": "hi", "temperature": "hot"},
    "temperature NaN": '{"prompt": "hi", "temperature": NaN}',
    "temperature inf": '{"prompt": "hi", "temperature": 1e999}',
    "top_p 0": {"prompt": "hi", "top_p": 0},
    "top_p 1.5": {"prompt": "hi", "top_p": 1.5},
    "max_tokens 0": {"prompt": "hi", "max_tokens": 0},
    "max_tokens -5": {"prompt": "hi", "max_tokens": -5},
    "max_tokens 2**40": {"prompt": "hi", "max_tokens": 2**40},
    "max_tokens 1.5": {"prompt": "hi", "max_tokens": 1.5},
    "n 0": {"prompt": "hi", "n": 0},
    "n 17": {"prompt": "hi", "n": 17},
    "empty stop": {"prompt": "hi", "stop": ""},
    "empty stop in list": {"prompt": "hi", "stop": ["a", ""]},
    "stop a number": {"prompt": "hi", "stop": 5},
    "presence_penalty 3": {"prompt": "hi", "presence_penalty": 3},
    "seed -1": {"prompt": "hi", "seed": -1},
    "logprobs 21": {"prompt": "hi", "logprobs": 21},
    "echo with logprobs": {"prompt": "hi", "echo": True, "logprobs": 1},
    "best_of 2": {"prompt": "hi", "best_of": 2},
    "stream a string": {"prompt": "hi", "stream": "yes"},
    "prompt too long": {"prompt": LONG},
    "prompt + max_tokens too long": {"prompt": "hi", "max_tokens": 600},
}
CHAT_INVALID = {
    "bad json": '{"messages": [',
    "missing messages": {"max_tokens": 2},
    "empty messages": {"messages": []},
    "messages not a list": {"messages": "hi"},
    "message not an object": {"messages": ["hi"]},
    "unknown role": {"messages": [{"role": "wizard", "content": "hi"}]},
    "missing content": {"messages": [{"role": "user"}]},
    "content a number": {"messages": [{"role": "user", "content": 5}]},
    "image content": {"messages": [{"role": "user", "content": IMAGE}]},
    "temperature -1": {"messages": PARIS, "temperature": -1},
    "top_p 0": {"messages": PARIS, "top_p": 0},
    "max_tokens 0": {"messages": PARIS, "max_tokens": 0},
    "max_completion_tokens -1": {"messages": PARIS, "max_completion_tokens": -1},
    "max_tokens 2**31": {"messages": PARIS, "max_tokens": 2**31},
    "n 17": {"messages": PARIS, "n": 17},
    "empty stop": {"messages": PARIS, "stop": ""},
    "logprobs a number": {"messages": PARIS, "logprobs": 3},
    "top_logprobs 30": {"messages": PARIS, "logprobs": True, "top_logprobs": 30},
    "top_logprobs without logprobs": {"messages": PARIS, "top_logprobs": 2},
    "tools": {"messages": PARIS, "tools": [{"type": "function", "function": {"name": "f"}}]},
    "messages too long": {"messages": [{"role": "user", "content": LONG}]},
    "prompt + max_tokens too long": {"messages": PARIS, "max_tokens": 600},
}
PARAMS = {  # the error's ``param`` for some cases
    "token id out of vocab": "prompt",
    "temperature -1": "temperature",
    "stop a number": "stop",
    "max_tokens 0": "max_tokens",
    "n 17": "n",
    "unknown role": "messages.0.role",
    "content a number": "messages.0.content",
    "messages too long": "messages",
}
CASES = [("/v1/completions", c, b) for c, b in COMPLETIONS_INVALID.items()] + [
    ("/v1/chat/completions", c, b) for c, b in CHAT_INVALID.items()
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "case", "body"), CASES, ids=[f"{r}:{c}" for r, c, _ in CASES])
def test_invalid_request_is_400_then_server_still_serves(http, route, case, body, stream):
    if isinstance(body, dict):
        body = json.dumps({**body, "stream": body.get("stream", stream)})
    r = http.post(route, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error" and err["message"], err
    assert "Traceback" not in err["message"]
    assert err["param"] == PARAMS.get(case, err["param"]), err
    if "max_tokens too long" in case:
        assert "600" in err["message"] and str(MAX_MODEL_LEN) in err["message"], err
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1, ok.text


def test_wrong_content_type_and_unknown_v1_route(http):
    body = json.dumps({"prompt": "hi", "max_tokens": 1})
    r = http.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "message" in r.json()["error"], r.text
    tgi = http.post("/generate", json={"inputs": ""})
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation", "TGI keeps 422"


# ---- in-process, on dummy:tiny: a client that goes away aborts every choice --------------------


def test_stream_disconnect_aborts_every_choice(monkeypatch):
    llm = AsyncLLM(EngineConfig(model="dummy:tiny"))
    aborted: list[str] = []
    real_abort, real_execute = llm.abort, llm.engine.runner.execute
    monkeypatch.setattr(llm, "abort", lambda rid: (aborted.append(rid), real_abort(rid)))
    slow = lambda seqs: (time.sleep(0.02), real_execute(seqs))[1]
    monkeypatch.setattr(llm.engine.runner, "execute", slow)
    body = {"prompt": "hello", "max_tokens": 1500, "n": 3, "stream": True}
    with server_thread(build_app(llm=llm)) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = sse_events(r.iter_lines())
                next(events), next(events), next(events)  # then the client goes away
        deadline = time.monotonic() + 10
        while len(aborted) < 3 or llm.engine.has_unfinished():
            assert time.monotonic() < deadline, f"aborted {aborted}"
            time.sleep(0.02)
