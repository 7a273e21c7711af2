"""The HTTP API end to end: a real server process on the default model (SmolLM2-135M-Instruct on
CPU), plus an in-process server on ``dummy:tiny`` for what needs a hand on the engine (client
disconnects, failing steps)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import server_process, server_thread, sse_events

from flashserve.config import EngineConfig
from flashserve.engine.async_llm import AsyncLLM
from server.app import build_app

MAX_MODEL_LEN = 512  # a small context keeps the "too long" cases cheap
CHATML_PARIS = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def url():
    with server_process("--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _generate(client: httpx.Client, inputs: str, **parameters) -> dict:
    r = client.post("/generate", json={"inputs": inputs, "parameters": parameters})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(client: httpx.Client, inputs: str, **parameters) -> list[dict]:
    body = {"inputs": inputs, "parameters": parameters}
    with client.stream("POST", "/generate_stream", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(sse_events(r.iter_lines()))


# ---- the default model -----------------------------------------------------------------------


def test_health_and_info(client):
    assert client.get("/health").status_code == 200
    info = client.get("/info").json()
    assert info["model_id"].startswith("SmolLM2-135M-Instruct"), info
    assert info["model_dtype"] == "torch.float32"
    assert info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == MAX_MODEL_LEN
    assert info["max_input_tokens"] == MAX_MODEL_LEN - 1
    assert info["kv_cache_dtype"] == "float32" and info["kv_cache_tokens"] > 0, info
    assert info["kv_cache_gib"] > 0
    assert info["version"]


def test_generate_greedy_answers_paris(client):
    out = _generate(client, CHATML_PARIS, max_new_tokens=20)
    assert set(out) == {"generated_text"}, "details only when asked for"
    assert "Paris" in out["generated_text"], out


def test_plain_question_is_answered_through_the_chat_template(client):
    """The issue's acceptance check: a bare question to the default (chat) model."""
    out = _generate(client, "What is the capital of France?", max_new_tokens=24)
    assert "Paris" in out["generated_text"], out


def test_as_prompt_wraps_only_plain_text_for_chat_models():
    from types import SimpleNamespace

    from flashserve.loaders.load import default_model_path
    from flashserve.tokenizer.tokenizer import Tokenizer
    from server.tgi import _as_prompt

    llm = SimpleNamespace(tokenizer=Tokenizer.from_gguf(default_model_path()))
    wrapped = _as_prompt(llm, "Hi there", raw=False)
    assert wrapped.startswith("<|im_start|>") and "<|im_start|>user\nHi there<|im_end|>" in wrapped
    assert wrapped.endswith("<|im_start|>assistant\n")
    assert _as_prompt(llm, "Hi there", raw=True) == "Hi there"
    assert _as_prompt(llm, CHATML_PARIS, raw=False) == CHATML_PARIS
    no_template = SimpleNamespace(tokenizer=Tokenizer.byte_level(512, 1, 2))
    assert _as_prompt(no_template, "Hi there", raw=False) == "Hi there"


def test_generate_details(client):
    out = _generate(client, CHATML_PARIS, max_new_tokens=20, details=True)
    details = out["details"]
    assert details["finish_reason"] == "eos_token"
    assert details["seed"] is None, "greedy: no seed"
    assert details["prefill"] == []
    tokens = details["tokens"]
    assert details["generated_tokens"] == len(tokens) > 1
    for tok in tokens:
        assert set(tok) == {"id", "text", "logprob", "special"}
        assert isinstance(tok["id"], int) and tok["logprob"] <= 0.0
    assert tokens[-1]["special"] and not any(t["special"] for t in tokens[:-1])
    assert "".join(t["text"] for t in tokens[:-1]) == out["generated_text"]


def test_return_full_text_and_length_limit(client):
    out = _generate(client, CHATML_PARIS, max_new_tokens=3, details=True, return_full_text=True)
    assert out["details"]["finish_reason"] == "length"
    assert out["details"]["generated_tokens"] == 3
    assert out["generated_text"].startswith(CHATML_PARIS)
    assert len(out["generated_text"]) > len(CHATML_PARIS)


def test_generate_stream(client):
    events = _stream(client, CHATML_PARIS, max_new_tokens=20)
    assert len(events) > 1
    assert [e["index"] for e in events] == list(range(1, len(events) + 1))
    for e in events[:-1]:
        assert e["generated_text"] is None and e["details"] is None
    last = events[-1]
    assert last["details"]["finish_reason"] == "eos_token"
    assert last["details"]["generated_tokens"] == len(events), "one event per token"
    texts = [e["token"]["text"] for e in events if not e["token"]["special"]]
    assert last["generated_text"] == "".join(texts)
    assert (
        last["generated_text"]
        == _generate(client, CHATML_PARIS, max_new_tokens=20)["generated_text"]
    ), "streamed and non-streamed greedy outputs differ"
    assert "Paris" in last["generated_text"]


def test_seeded_sampling_is_reproducible(client):
    params = dict(max_new_tokens=8, do_sample=True, temperature=0.9, seed=1234, details=True)
    first = _generate(client, "Once upon a time", **params)
    second = _generate(client, "Once upon a time", **params)
    assert first["generated_text"] == second["generated_text"]
    assert first["details"]["seed"] == 1234
    streamed = _stream(client, "Once upon a time", **params)
    assert streamed[-1]["generated_text"] == first["generated_text"]
    assert streamed[-1]["details"]["seed"] == 1234


def test_concurrent_requests_match_sequential(url, client):
    prompts = [f"{CHATML_PARIS}{word}" for word in ("The", "Paris", "It", "France")]
    sequential = [_generate(client, p, max_new_tokens=6)["generated_text"] for p in prompts]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as ac:
            body = lambda p: {"inputs": p, "parameters": {"max_new_tokens": 6}}
            rs = await asyncio.gather(*(ac.post("/generate", json=body(p)) for p in prompts))
        return [r.json()["generated_text"] for r in rs]

    assert asyncio.run(together()) == sequential


def test_root_route_as_tgi_clients_use_it(client):
    """TGI's Python client posts to "/": a list of one response (full text by default), or
    the stream when ``stream`` is true."""
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    r = client.post("/", json=body)
    assert r.status_code == 200, r.text
    [out] = r.json()
    assert out["generated_text"].startswith("Hello") and len(out["generated_text"]) > 5
    with client.stream("POST", "/", json={**body, "stream": True}) as r:
        events = list(sse_events(r.iter_lines()))
    assert len(events) == 2 and events[-1]["details"]["generated_tokens"] == 2
    assert client.post("/", json={"inputs": ""}).status_code == 422


INVALID = {
    "bad json": '{"inputs": "hi",',
    "not an object": '["hi"]',
    "missing inputs": {"parameters": {}},
    "empty inputs": {"inputs": ""},
    "inputs not a string": {"inputs": 5},
    "parameters not an object": {"inputs": "hi", "parameters": "fast"},
    "temperature a string": {"inputs": "hi", "parameters": {"temperature": "hot"}},
    "temperature -1": {"inputs": "hi", "parameters": {"temperature": -1}},
    "temperature 0": {"inputs": "hi", "parameters": {"temperature": 0}},
    "top_p 1.5": {"inputs": "hi", "parameters": {"top_p": 1.5}},
    "top_p 0": {"inputs": "hi", "parameters": {"top_p": 0}},
    "top_k 0": {"inputs": "hi", "parameters": {"top_k": 0}},
    "repetition_penalty 0": {"inputs": "hi", "parameters": {"repetition_penalty": 0}},
    "frequency_penalty 3": {"inputs": "hi", "parameters": {"frequency_penalty": 3}},
    "max_new_tokens 0": {"inputs": "hi", "parameters": {"max_new_tokens": 0}},
    "max_new_tokens -5": {"inputs": "hi", "parameters": {"max_new_tokens": -5}},
    "max_new_tokens 2**40": {"inputs": "hi", "parameters": {"max_new_tokens": 2**40}},
    "max_new_tokens 1.5": {"inputs": "hi", "parameters": {"max_new_tokens": 1.5}},
    "seed -1": {"inputs": "hi", "parameters": {"seed": -1, "do_sample": True}},
    "five stop sequences": {"inputs": "hi", "parameters": {"stop": list("abcde")}},
    "truncate 0": {"inputs": "hi", "parameters": {"truncate": 0}},
    "truncate over context": {"inputs": "hi", "parameters": {"truncate": 10**6}},
    "typical_p": {"inputs": "hi", "parameters": {"typical_p": 0.5}},
    "watermark": {"inputs": "hi", "parameters": {"watermark": True}},
    "best_of 2": {"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True}},
    "decoder_input_details": {"inputs": "hi", "parameters": {"decoder_input_details": True}},
    "prompt too long": {"inputs": "hello " * (MAX_MODEL_LEN + 10)},
    "prompt + max_new_tokens too long": {"inputs": "hi", "parameters": {"max_new_tokens": 600}},
}


@pytest.mark.parametrize("route", ["/generate", "/generate_stream"])
@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_request_is_422_then_server_still_serves(client, route, case):
    body = INVALID[case]
    content = body if isinstance(body, str) else json.dumps(body)
    r = client.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == "validation", err
    assert err["error"] and "Traceback" not in err["error"]
    if case == "prompt + max_new_tokens too long":
        assert "600" in err["error"] and str(MAX_MODEL_LEN) in err["error"], err
    assert _generate(client, "Hello", max_new_tokens=1)["generated_text"] is not None


def test_unknown_route_is_json(client):
    r = client.get("/no-such-route")
    assert r.status_code == 404
    assert r.json() == {"error": "Not Found", "error_type": "http"}


# ---- in-process, on dummy:tiny, with a hand on the engine ----------------------------------


@pytest.fixture(scope="module")
def tiny():
    llm = AsyncLLM(EngineConfig(model="dummy:tiny"))
    with server_thread(build_app(llm=llm)) as base:
        yield base, llm


def _record_aborts(monkeypatch, llm: AsyncLLM) -> list[str]:
    aborted: list[str] = []
    real = llm.abort
    monkeypatch.setattr(llm, "abort", lambda rid: (aborted.append(rid), real(rid)))
    return aborted


def _slow_steps(monkeypatch, llm: AsyncLLM, seconds: float = 0.02) -> None:
    runner = llm.engine.runner
    real = runner.execute
    monkeypatch.setattr(runner, "execute", lambda seqs: (time.sleep(seconds), real(seqs))[1])


def _wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while llm.engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine still runs the request"
        time.sleep(0.02)


def test_stream_client_disconnect_aborts(tiny, monkeypatch):
    base, llm = tiny
    aborted = _record_aborts(monkeypatch, llm)
    _slow_steps(monkeypatch, llm)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 1500}}
    with httpx.Client(base_url=base, timeout=30) as c:
        with c.stream("POST", "/generate_stream", json=body) as r:
            events = sse_events(r.iter_lines())
            next(events), next(events)  # two tokens, then the client goes away
    deadline = time.monotonic() + 10
    while not aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    _wait_idle(llm)


def test_generate_client_disconnect_aborts(tiny, monkeypatch):
    base, llm = tiny
    aborted = _record_aborts(monkeypatch, llm)
    _slow_steps(monkeypatch, llm)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 1500}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/generate", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while not aborted:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    _wait_idle(llm)


def test_engine_error_is_424_or_error_event(tiny, monkeypatch):
    base, llm = tiny
    runner = llm.engine.runner
    real, calls = runner.execute, []

    def fail_on_third_step(seqs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device fell over")
        return real(seqs)

    monkeypatch.setattr(runner, "execute", fail_on_third_step)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 10}}
    with httpx.Client(base_url=base, timeout=60) as c:
        with c.stream("POST", "/generate_stream", json=body) as r:
            events = list(sse_events(r.iter_lines()))
        assert [set(e) for e in events[:-1]] == [
            {"index", "token", "generated_text", "details"}
        ] * 2
        assert events[-1]["error_type"] == "generation"
        assert "could not compute" in events[-1]["error"]
        assert "fell over" not in events[-1]["error"]  # internals stay in the log
        calls.clear()
        r = c.post("/generate", json=body)
        assert r.status_code == 424 and r.json()["error_type"] == "generation", r.text
        monkeypatch.setattr(runner, "execute", real)
        assert c.post("/generate", json=body).status_code == 200


def test_unexpected_error_is_500_without_details(tiny, monkeypatch):
    base, llm = tiny

    def broken(*args, **kwargs):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(llm.engine, "make_request", broken)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2}}
    with httpx.Client(base_url=base, timeout=60) as c:
        for route in ("/generate", "/generate_stream"):
            r = c.post(route, json=body)
            assert r.status_code == 500
            assert r.json() == {"error": "internal server error", "error_type": "internal"}
        monkeypatch.undo()
        assert c.post("/generate", json=body).status_code == 200


def test_health_is_503_once_the_engine_stopped():
    llm = AsyncLLM(EngineConfig(model="dummy:tiny"))
    with server_thread(build_app(llm=llm)) as base:
        assert httpx.get(f"{base}/health").status_code == 200
        llm.shutdown()
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
        assert httpx.post(f"{base}/generate", json={"inputs": "hi"}).status_code == 503
    assert not llm.is_running
