"""Prefix caching as clients see it: a real server process on the default model (CPU), once with
caching on (the default) and once with ``--no-prefix-caching``. A second request that shares a
long prefix with the first reports ``usage.prompt_tokens_details.cached_tokens`` (OpenAI), the
TGI ``details`` carry ``cached_tokens``, ``/info`` says whether caching is on, and ``/metrics``
counts the queries and hits in tokens."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import server_process, sse_events

from flashserve.engine.messages import EngineStats
from flashserve.engine.outputs import RequestOutput

openai = pytest.importorskip("openai")  # in the test extra; absent on the GPU machine

BLOCK = 16  # --block-size below: cached tokens come in whole blocks
PREFIX = 10 * BLOCK  # shared prompt tokens, a whole number of blocks
ARGS = ("--max-model-len", "1024", "--block-size", str(BLOCK))
SYSTEM = " ".join(f"Rule {i}: answer briefly and politely, in plain English." for i in range(30))


@pytest.fixture(scope="module")
def on():
    with server_process(*ARGS) as base:
        yield base


@pytest.fixture(scope="module")
def off():
    with server_process(*ARGS, "--no-prefix-caching") as base:
        yield base


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]  # clear of the special tokens


def _complete(base: str, prompt, stream: bool = False, **extra) -> dict:
    """A completion's usage (from the final chunk when streamed)."""
    body = {"prompt": prompt, "max_tokens": 2, "stream": stream, **extra}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = (x for x in r.iter_lines() if x != "data: [DONE]")
        usages = [e["usage"] for e in sse_events(lines) if e.get("usage")]
    assert len(usages) == 1, usages
    return usages[0]


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def _samples(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _settled(base: str, before: dict, queries: int) -> dict:
    """/metrics once the engine's stats snapshot shows ``queries`` more query tokens (the core
    publishes one every step and every 0.5 s while idle)."""
    deadline = time.monotonic() + 10
    while True:
        after = _samples(base)
        got = after["flashserve_prefix_cache_queries_total"]
        if got - before["flashserve_prefix_cache_queries_total"] >= queries:
            return after
        assert time.monotonic() < deadline, f"queries stayed at {got}"
        time.sleep(0.1)


# ---- caching on ------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_second_completion_reports_the_shared_prefix_and_metrics_count_it(on, stream):
    rng = random.Random(f"completion-{stream}")
    shared = _ids(rng, PREFIX)
    before = _samples(on)
    first = _complete(on, shared + _ids(rng, 7), stream)
    second = _complete(on, shared + _ids(rng, 9), stream)
    assert _cached(first) == 0, first  # a fresh random prefix: nothing to find
    # the whole shared prefix, and not the block that holds the new question
    assert _cached(second) == PREFIX, second
    assert second["prompt_tokens"] == PREFIX + 9
    after = _settled(on, before, first["prompt_tokens"] + second["prompt_tokens"])
    queries = after["flashserve_prefix_cache_queries_total"]
    hits = after["flashserve_prefix_cache_hits_total"]
    assert queries - before["flashserve_prefix_cache_queries_total"] == (
        first["prompt_tokens"] + second["prompt_tokens"]
    )
    assert hits - before["flashserve_prefix_cache_hits_total"] == PREFIX
    assert after["flashserve_prefix_cache_hit_rate"] == pytest.approx(hits / queries)


def test_cached_tokens_count_each_prompt_once_like_prompt_tokens(on):
    """Two prompts whose prefixes were computed before, n=2: prompt_tokens counts each prompt
    once, and so does cached_tokens (not once per choice)."""
    rng = random.Random("n")
    a, b = _ids(rng, PREFIX), _ids(rng, PREFIX + BLOCK)
    _complete(on, [a + _ids(rng, 3), b + _ids(rng, 3)])
    usage = _complete(on, [a + _ids(rng, 5), b + _ids(rng, 6)], n=2, temperature=1.0, seed=3)
    assert usage["prompt_tokens"] == 2 * PREFIX + BLOCK + 11
    assert _cached(usage) == 2 * PREFIX + BLOCK, usage


def test_chat_reports_cached_tokens_through_the_openai_client(on):
    oai = openai.OpenAI(base_url=f"{on}/v1", api_key="unused", max_retries=0, timeout=120)
    model = oai.models.list().data[0].id

    def ask(question: str, **kwargs):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return oai.chat.completions.create(model=model, messages=messages, max_tokens=2, **kwargs)

    ask("What is the capital of France?")
    usage = ask("What is the capital of Italy?").usage
    # the system turn is the shared prefix; the question differs, so not every block matches
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens, usage
    assert usage.prompt_tokens_details.cached_tokens % BLOCK == 0
    chunks = list(ask("What is the capital of Spain?", stream=True,
                      stream_options={"include_usage": True}))  # fmt: skip
    streamed = chunks[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens == usage.prompt_tokens_details.cached_tokens


def test_tgi_details_and_info_say_what_was_cached(on):
    assert httpx.get(f"{on}/info").json()["prefix_caching"] is True
    inputs = f"{SYSTEM} Now count from one to ten."
    params = {"max_new_tokens": 2, "details": True}
    r1 = httpx.post(f"{on}/generate", json={"inputs": inputs, "parameters": params}, timeout=120)
    r2 = httpx.post(f"{on}/generate", json={"inputs": inputs, "parameters": params}, timeout=120)
    first, second = r1.json()["details"], r2.json()["details"]
    assert second["cached_tokens"] > 0 and second["cached_tokens"] % BLOCK == 0, second
    assert second["cached_tokens"] >= first["cached_tokens"]
    body = {"inputs": inputs, "parameters": params}
    with httpx.stream("POST", f"{on}/generate_stream", json=body, timeout=120) as r:
        events = list(sse_events(r.iter_lines()))
    assert events[-1]["details"]["cached_tokens"] == second["cached_tokens"]
    # what TGI clients parse is unchanged (pydantic ignores the extra field)
    assert {"finish_reason", "generated_tokens", "seed", "tokens"} <= set(second)


# ---- caching off -----------------------------------------------------------------------------


def test_without_prefix_caching_nothing_is_cached(off):
    assert httpx.get(f"{off}/info").json()["prefix_caching"] is False
    rng = random.Random("off")
    shared = _ids(rng, PREFIX)
    _complete(off, shared + _ids(rng, 7))
    assert _cached(_complete(off, shared + _ids(rng, 9))) == 0
    assert _cached(_complete(off, shared + _ids(rng, 9), stream=True)) == 0
    time.sleep(0.6)  # one idle stats snapshot later
    samples = _samples(off)
    assert samples["flashserve_prefix_cache_queries_total"] == 0
    assert samples["flashserve_prefix_cache_hits_total"] == 0
    assert "flashserve_prefix_cache_hit_rate" not in samples  # 0 of 0 is no rate


# ---- pieces, in process ----------------------------------------------------------------------


def test_usage_takes_each_prompt_once_whichever_choice_finishes_first():
    from server.openai import _usage

    def last(cached: int, generated: int) -> RequestOutput:
        return RequestOutput("r", [], True, "length", num_generated_tokens=generated,
                             num_cached_tokens=cached)  # fmt: skip

    # two prompts, n=2: a later choice found what an earlier one computed
    usage = _usage(100, [last(0, 1), last(48, 2), last(32, 3), last(32, 4)], n=2)
    assert usage.prompt_tokens_details.cached_tokens == 0 + 32
    assert usage.completion_tokens == 10 and usage.total_tokens == 110


def test_hit_rate_gauge_follows_the_stats_snapshot():
    from server.metrics import _EngineCollector

    def scrape(queries: int, hits: int) -> dict[str, float]:
        stats = EngineStats(time.monotonic(), running=0, waiting=0, kv_usage=0.0, preemptions=0,
                            unfinished=0, prefix_cache_queries=queries,
                            prefix_cache_hits=hits)  # fmt: skip
        registry = CollectorRegistry()
        llm = SimpleNamespace(stats=lambda: stats)
        registry.register(_EngineCollector(SimpleNamespace(state=SimpleNamespace(llm=llm))))
        text = generate_latest(registry).decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}

    values = scrape(4000, 3000)
    assert values["flashserve_prefix_cache_queries_total"] == 4000
    assert values["flashserve_prefix_cache_hits_total"] == 3000
    assert values["flashserve_prefix_cache_hit_rate"] == 0.75
    assert "flashserve_prefix_cache_hit_rate" not in scrape(0, 0)
