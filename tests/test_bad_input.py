"""Bad input on every generation route, against one real server process on a tiny model
(``dummy:tiny``'s shape, saved as a Hugging Face directory with a chat template, which dummy
models lack and the chat route needs).

Each row of the table is (route, case, body, status, field): the answer must have that status,
the route's error shape (TGI's ``{"error", "error_type"}`` with 422, OpenAI's ``{"error":
{"message", "type", "param", "code"}}`` with 400, ``param`` the field) and name the field.
Rows whose status is None are values that are fine as Python floats but not as the float32 the
device computes with: they may be refused (4xx naming the field) or served (200, a sane
generation), and they must never disturb a request in the same batch. After the table the server
still serves, /health says 200, and its log holds no traceback.

The whole table runs twice: on the CPU here, and with ``--device cuda`` on the GPU machine
(marked ``gpu``: skipped without one).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file
from server_utils import server_process, sse_events
from tokenizers import Tokenizer, models, pre_tokenizers

from flashserve.models.presets import PRESETS

MAX_MODEL_LEN = 256
VOCAB = 512  # dummy:tiny's
TGI_ROUTES = ("/generate", "/generate_stream", "/")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
SURROGATES = ("\ud800", "\udfff", "\udcff")  # high, low, and what argv makes of a 0xFF byte


# every string field of a message reaches the tokenizer through the template
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m.name %}({{ m.name }}){% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %} {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class Server:
    url: str
    log: Path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """``dummy:tiny`` as a Hugging Face directory: random weights, a word-level tokenizer (any
    text encodes, as ``<unk>`` at worst) and ``TEMPLATE``."""
    path = tmp_path_factory.mktemp("tiny")
    config = PRESETS["tiny"]
    weights = {name: torch.ones(shape) if name.endswith("norm.weight") else
               torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.02
               for i, (name, shape) in enumerate(_hf_shapes(config).items())}  # fmt: skip
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(special))
    return path


def _hf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The Hugging Face Llama tensor names and shapes of ``config``."""
    h, f, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    v = config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}  # fmt: skip
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,),
             "self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
             "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
             "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{k}.weight": s for k, s in layer.items()})
    return shapes


@pytest.fixture(
    scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # fmt: skip
def server(request, model_dir, tmp_path_factory) -> Iterator[Server]:
    """One server per device, its output in a log file that the last test reads."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ("--model", str(model_dir), "--device", request.param,
            "--max-model-len", str(MAX_MODEL_LEN))  # fmt: skip
    with server_process(*args, log_path=log) as url:
        yield Server(url, log)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


# ---- the table -------------------------------------------------------------------------------

# values that pass as Python floats but round to 0 or overflow to inf in float32
FLOAT32 = {
    "top_p": [1e-46],
    "temperature": [1e-46, 1e39],
    "min_p": [1e-46],
    "repetition_penalty": [1e-46, 1e39],
    "presence_penalty": [1e-46],
    "frequency_penalty": [1e-46],
}
TGI_PARAMS = {"top_p", "temperature", "repetition_penalty", "frequency_penalty"}


def _tgi_cases() -> list[tuple[str, dict | str, int | None, str]]:
    """(case, body, status, field) for the TGI routes."""

    def p(**parameters) -> dict:
        return {"inputs": "hi", "parameters": {"max_new_tokens": 4, **parameters}}

    cases = [(f"inputs {s!a}", {"inputs": f"a{s}b"}, 422, "inputs") for s in SURROGATES]
    cases += [
        ("stop with a lone surrogate", p(stop=["ok", "x\ud800"]), 422, "stop"),
        ("inputs a number", {"inputs": 5}, 422, "inputs"),
        ("inputs a list of ids", {"inputs": [1, 2]}, 422, "inputs"),
        ("parameters a string", {"inputs": "hi", "parameters": "fast"}, 422, "parameters"),
        ("temperature a string", p(temperature="hot"), 422, "temperature"),
        ("max_new_tokens a float", p(max_new_tokens=1.5), 422, "max_new_tokens"),
        ("stop a string", p(stop="abc"), 422, "stop"),
        ("stop of numbers", p(stop=[1]), 422, "stop"),
        ("details a string", p(details="yes"), 422, "details"),
        (
            "temperature NaN",
            '{"inputs": "hi", "parameters": {"temperature": NaN}}',
            422,
            "temperature",
        ),  # fmt: skip
        ("temperature -1", p(temperature=-1), 422, "temperature"),
        ("top_p 1.5", p(top_p=1.5), 422, "top_p"),
        ("top_k 0", p(top_k=0), 422, "top_k"),
        ("repetition_penalty 0", p(repetition_penalty=0), 422, "repetition_penalty"),
        ("frequency_penalty 3", p(frequency_penalty=3), 422, "frequency_penalty"),
        ("max_new_tokens 0", p(max_new_tokens=0), 422, "max_new_tokens"),
        ("max_new_tokens 2**40", p(max_new_tokens=2**40), 422, "max_new_tokens"),
        (
            "max_new_tokens over the context",
            p(max_new_tokens=MAX_MODEL_LEN),
            422,
            "max_new_tokens",
        ),  # fmt: skip
        ("seed -1", p(seed=-1, do_sample=True), 422, "seed"),
        ("truncate 0", p(truncate=0), 422, "truncate"),
        ("empty inputs", {"inputs": ""}, 422, "inputs"),
        ("five stop strings", p(stop=list("abcde")), 422, "stop"),
    ]
    for name, values in FLOAT32.items():
        if name in TGI_PARAMS:
            cases += [(f"{name} {v}", p(**{name: v}), None, name) for v in values]
    return cases


def _openai_cases(base: dict) -> list[tuple[str, dict | str, int | None, str]]:
    """(case, body, status, field) that both OpenAI routes share, on top of ``base``."""

    def b(**fields) -> dict:
        return {**base, "max_tokens": 4, **fields}

    cases = [(f"stop {s!a}", b(stop=f"x{s}"), 400, "stop") for s in SURROGATES]
    cases += [
        ("stop list with a lone surrogate", b(stop=["ok", "\ud800"]), 400, "stop"),
        ("temperature a string", b(temperature="hot"), 400, "temperature"),
        ("n a string", b(n="2"), 400, "n"),
        ("stop a number", b(stop=5), 400, "stop"),
        ("stream a string", b(stream="yes"), 400, "stream"),
        ("max_tokens a float", b(max_tokens=1.5), 400, "max_tokens"),
        ("seed a float", b(seed=1.5), 400, "seed"),
        ("temperature -1", b(temperature=-1), 400, "temperature"),
        ("top_p 0", b(top_p=0), 400, "top_p"),
        ("top_p 1.5", b(top_p=1.5), 400, "top_p"),
        ("top_k -5", b(top_k=-5), 400, "top_k"),
        ("min_p 2", b(min_p=2), 400, "min_p"),
        ("repetition_penalty 0", b(repetition_penalty=0), 400, "repetition_penalty"),
        ("repetition_penalty -1", b(repetition_penalty=-1), 400, "repetition_penalty"),
        ("presence_penalty 3", b(presence_penalty=3), 400, "presence_penalty"),
        ("frequency_penalty -3", b(frequency_penalty=-3), 400, "frequency_penalty"),
        ("seed -1", b(seed=-1), 400, "seed"),
        ("n 0", b(n=0), 400, "n"),
        ("n 17", b(n=17), 400, "n"),
        ("max_tokens 0", b(max_tokens=0), 400, "max_tokens"),
        ("max_tokens 2**40", b(max_tokens=2**40), 400, "max_tokens"),
        ("max_tokens over the context", b(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
        ("17 stop strings", b(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ]
    for name, values in FLOAT32.items():
        cases += [(f"{name} {v}", b(**{name: v}), None, name) for v in values]
    return cases


def _completion_cases() -> list[tuple[str, dict | str, int | None, str]]:
    def b(prompt) -> dict:
        return {"prompt": prompt, "max_tokens": 4}

    cases = [(f"prompt {s!a}", b(f"a{s}b"), 400, "prompt") for s in SURROGATES]
    cases += [
        ("prompt list with a lone surrogate", b(["ok", "a\ud800"]), 400, "prompt"),
        ("prompt a number", b(5), 400, "prompt"),
        ("prompt of floats", b([1.5, 2]), 400, "prompt"),
        ("prompt of booleans", b([True]), 400, "prompt"),
        ("token id 10**9", b([10**9]), 400, "prompt"),
        ("token id = vocab size", b([1, VOCAB]), 400, "prompt"),
        ("token id -1", b([-1]), 400, "prompt"),
        ("token id out of vocab in a list", b([[1, 2], [VOCAB + 3]]), 400, "prompt"),
        ("empty prompt", b(""), 400, "prompt"),
        ("empty prompt list", b([]), 400, "prompt"),
        ("empty prompt in a list", b(["hi", ""]), 400, "prompt"),
        ("prompt too long", b([5] * MAX_MODEL_LEN), 400, "max_tokens"),
        ("logprobs 21", {**b("hi"), "logprobs": 21}, 400, "logprobs"),
        ("logprobs -1", {**b("hi"), "logprobs": -1}, 400, "logprobs"),
    ]
    return cases + _openai_cases({"prompt": "hi"})


def _chat_cases() -> list[tuple[str, dict | str, int | None, str]]:
    def b(*messages, **fields) -> dict:
        return {"messages": list(messages), "max_tokens": 4, **fields}

    def user(**fields) -> dict:
        return {"role": "user", "content": "hi", **fields}

    cases = [(f"content {s!a}", b(user(content=f"a{s}")), 400, "messages.0.content")
             for s in SURROGATES]  # fmt: skip
    parts = [{"type": "text", "text": "ok"}, {"type": "text", "text": "b\ud800"}]
    cases += [
        ("text part with a lone surrogate", b(user(content=parts)), 400, "messages.0.content"),
        (
            "second message",
            b(user(), {"role": "assistant", "content": "\udc00"}),
            400,
            "messages.1.content",
        ),  # fmt: skip
        ("name with a lone surrogate", b(user(name="n\ud800")), 400, "messages.0.name"),
        (
            "tool_call_id with a lone surrogate",
            b(user(), {"role": "tool", "content": "x", "tool_call_id": "\ud800"}),
            400,
            "messages.1.tool_call_id",
        ),  # fmt: skip
        ("messages a string", {"messages": "hi"}, 400, "messages"),
        ("content a number", b(user(content=5)), 400, "messages.0.content"),
        ("unknown role", b(user(role="wizard")), 400, "messages.0.role"),
        ("empty messages", b(), 400, "messages"),
        (
            "messages too long",
            {"messages": [user(content="hi " * MAX_MODEL_LEN)]},
            400,
            "messages",
        ),  # fmt: skip
        ("logprobs a number", b(user(), logprobs=3), 400, "logprobs"),
        ("top_logprobs 21", b(user(), logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        (
            "max_completion_tokens 0",
            b(user(), max_completion_tokens=0),
            400,
            "max_completion_tokens",
        ),  # fmt: skip
    ]
    return cases + _openai_cases({"messages": HI})


ROWS = (
    [(r, *c) for r in TGI_ROUTES for c in _tgi_cases()]
    + [(COMPLETIONS, *c) for c in _completion_cases()]
    + [(CHAT, *c) for c in _chat_cases()]
)


def _post(http: httpx.Client, route: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return http.post(route, content=content, headers={"content-type": "application/json"})


def _assert_names_field(route: str, r: httpx.Response, status: int, field: str) -> None:
    """The route's error shape, that status, and the field named (OpenAI: as ``param``)."""
    assert r.status_code == status, r.text
    if route.startswith("/v1/"):
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["type"] == "invalid_request_error" and err["message"], err
        assert err["param"] == field, err
    else:
        err = r.json()
        assert set(err) == {"error", "error_type"} and err["error_type"] == "validation", err
        assert field in err["error"], err


def _assert_sane(route: str, r: httpx.Response, max_tokens: int) -> str:
    """A 200 with a whole generation of at most ``max_tokens`` tokens; returns its text."""
    assert r.status_code == 200, r.text
    if route == "/generate_stream" or (route == "/" and r.text.startswith("data:")):
        events = list(sse_events(r.text.splitlines()))
        assert "error" not in events[-1], events[-1]
        assert 1 <= events[-1]["details"]["generated_tokens"] <= max_tokens, events[-1]
        return events[-1]["generated_text"]
    out = r.json()
    if route in TGI_ROUTES:
        return (out[0] if route == "/" else out)["generated_text"]
    assert 1 <= out["usage"]["completion_tokens"] <= max_tokens, out
    choice = out["choices"][0]
    return choice["text"] if route == COMPLETIONS else choice["message"]["content"]


REFERENCE = {"prompt": "The same text", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize(
    ("route", "case", "body", "status", "field"), ROWS, ids=[f"{r} {c}" for r, c, *_ in ROWS]
)
def test_bad_request_is_4xx_naming_the_field(http, route, case, body, status, field):
    if status is not None:
        _assert_names_field(route, _post(http, route, body), status, field)
        return
    # a float32 edge case: refused, or served, and the greedy request beside it unchanged
    alone = _post(http, COMPLETIONS, REFERENCE).json()["choices"][0]["text"]
    with ThreadPoolExecutor(2) as pool:
        odd = pool.submit(_post, http, route, body)
        beside = pool.submit(_post, http, COMPLETIONS, REFERENCE).result()
        odd = odd.result()
    if odd.status_code != 200:
        _assert_names_field(route, odd, 422 if route in TGI_ROUTES else 400, field)
    else:
        _assert_sane(route, odd, 4)
    assert _assert_sane(COMPLETIONS, beside, 16) == alone, "the request beside it changed"


GOOD = {
    "/generate": {"inputs": "hello", "parameters": {"max_new_tokens": 3}},
    "/generate_stream": {"inputs": "hello", "parameters": {"max_new_tokens": 3}},
    "/": {"inputs": "hello", "parameters": {"max_new_tokens": 3}},
    COMPLETIONS: {"prompt": "hello", "max_tokens": 3},
    CHAT: {"messages": HI, "max_tokens": 3},
}


@pytest.mark.parametrize("route", list(GOOD))
def test_after_the_table_every_route_still_serves(http, route):
    _assert_sane(route, _post(http, route, GOOD[route]), 3)
    assert http.get("/health").status_code == 200


def test_no_traceback_in_the_server_log(server: Server):
    """Last in this module: nothing above made the server log an unexpected error."""
    text = server.log.read_text(errors="replace")
    assert "Traceback" not in text, text[-4000:]
    assert " 500 " not in text, [line for line in text.splitlines() if " 500 " in line]
