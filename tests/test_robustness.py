"""The server under abuse, in-process on ``dummy:tiny`` (a hand on the engine behind it): a storm
of clients that go away mid-stream, a request whose rows make a step fail, an engine thread
that dies.

After each, the engine must be clean (no running or waiting sequence, every KV block free) and
serve again, or, when it cannot, say so on ``/health``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import server_thread, sse_events

from flashserve.config import EngineConfig
from flashserve.engine.async_llm import AsyncLLM
from server.app import build_app

ABORTED = "flashserve_aborted_requests_total"
LONG = 1500  # tokens: a stream that is still running when its client goes away
STEP_S = 0.005  # a slower step keeps the long requests alive while a test acts


@pytest.fixture(params=[False, True], ids=["plain", "async-scheduling"])
def llm(request, monkeypatch) -> AsyncLLM:
    """A fresh engine on dummy:tiny whose steps take at least ``STEP_S``: plain, and with
    async scheduling (the default on CUDA), whose decode steps go through ``launch``."""
    llm = AsyncLLM(EngineConfig(model="dummy:tiny", async_scheduling=request.param))
    runner = llm.engine.runner
    execute, launch = runner.execute, runner.launch
    monkeypatch.setattr(runner, "execute", lambda seqs: (time.sleep(STEP_S), execute(seqs))[1])
    monkeypatch.setattr(runner, "launch", lambda *a: (time.sleep(STEP_S), launch(*a))[1])
    return llm


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _engine_is_clean(llm: AsyncLLM) -> bool:
    engine = llm.engine
    return (
        not engine.has_unfinished()
        and engine.scheduler.num_running == 0
        and engine.scheduler.num_waiting == 0
        and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    )


def _samples(base: str) -> dict[str, float]:
    """The unlabelled samples of /metrics, by name."""
    text = httpx.get(f"{base}/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.labels}  # fmt: skip


# the streaming routes, each with a body that runs for LONG tokens
STREAMS = [
    ("/generate_stream", {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}),
    ("/", {"inputs": "hello", "parameters": {"max_new_tokens": LONG}, "stream": True}),
    (
        "/v1/completions",
        {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True, "stream": True},
    ),  # fmt: skip
]


# ---- a storm of disconnects ----------------------------------------------------------------


def test_disconnect_storm_frees_everything(llm):
    n = 24
    with server_thread(build_app(llm=llm)) as base:
        before = _samples(base)

        async def cut_after_first_token(ac: httpx.AsyncClient, i: int) -> None:
            route, body = STREAMS[i % len(STREAMS)]
            async with ac.stream("POST", route, json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"error' not in line:
                        return  # one token, then the client goes away
            raise AssertionError(f"{route}: the stream ended before its first token")

        async def storm() -> None:
            limits = httpx.Limits(max_connections=n)
            async with httpx.AsyncClient(base_url=base, timeout=30, limits=limits) as ac:
                await asyncio.gather(*(cut_after_first_token(ac, i) for i in range(n)))

        t0 = time.monotonic()
        asyncio.run(storm())
        _wait_for(lambda: _engine_is_clean(llm), "the engine to drop every aborted stream", 10)
        cleaned = time.monotonic() - t0
        aborted = lambda: _samples(base)[ABORTED] - before[ABORTED]  # noqa: E731
        _wait_for(lambda: aborted() >= n, "the aborts to be counted")
        after = _samples(base)
        assert after[ABORTED] - before[ABORTED] == n
        assert after["flashserve_num_requests_running"] == 0
        assert after["flashserve_num_requests_waiting"] == 0
        assert after["flashserve_kv_cache_usage_ratio"] == 0.0
        assert cleaned < 20, cleaned
        r = httpx.post(f"{base}/generate", json={"inputs": "hi", "parameters": {
            "max_new_tokens": 3, "details": True}}, timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.json()["details"]["generated_tokens"] == 3, r.text
        assert httpx.get(f"{base}/health").status_code == 200


# ---- a failing forward pass ----------------------------------------------------------------


BAD_SEED = 4242  # the request whose rows make every step that holds them fail


def _poison(monkeypatch, llm: AsyncLLM) -> None:
    """Every forward pass (run now, or queued with async scheduling) whose batch holds the
    BAD_SEED request raises, as a sampler fault tied to one request's values would."""
    runner = llm.engine.runner
    execute, launch = runner.execute, runner.launch

    def fault(seqs) -> None:
        if any(s.params.seed == BAD_SEED for s in seqs):
            raise IndexError("injected: index -1 is out of bounds")

    monkeypatch.setattr(runner, "execute", lambda seqs: (fault(seqs), execute(seqs))[1])
    monkeypatch.setattr(runner, "launch", lambda seqs, *a: (fault(seqs), launch(seqs, *a))[1])


def test_a_request_that_breaks_its_step_fails_alone_and_the_others_finish(llm, monkeypatch):
    """Four requests run (two streams, two plain) when one whose rows make the step fail
    joins: it alone gets a 424 with a message that shows no internals; the others finish with
    every token and no error event; the engine is clean and serves again."""
    _poison(monkeypatch, llm)
    tgi = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
    cmpl = {"prompt": "hello", "max_tokens": LONG, "ignore_eos": True}
    bad = {"prompt": "hello", "max_tokens": 8, "seed": BAD_SEED, "temperature": 0.7}
    with server_thread(build_app(llm=llm)) as base:

        async def stream(ac: httpx.AsyncClient, route: str, body: dict) -> list[str]:
            async with ac.stream("POST", route, json=body) as r:
                assert r.status_code == 200, await r.aread()
                return [line async for line in r.aiter_lines() if line.startswith("data:")]

        async def requests() -> list:
            async with httpx.AsyncClient(base_url=base, timeout=60) as ac:
                tasks = [
                    asyncio.ensure_future(ac.post("/generate", json=tgi)),
                    asyncio.ensure_future(ac.post("/v1/completions", json=cmpl)),
                    asyncio.ensure_future(stream(ac, "/generate_stream", tgi)),
                    asyncio.ensure_future(stream(ac, "/v1/completions", {**cmpl, "stream": True})),
                ]
                deadline = time.monotonic() + 15
                while llm.engine.scheduler.num_running < len(tasks):  # all in the batch
                    assert time.monotonic() < deadline, "the requests did not all start"
                    await asyncio.sleep(0.01)
                bad_r = await ac.post("/v1/completions", json=bad)
                return [bad_r, *await asyncio.gather(*tasks)]

        bad_r, tgi_r, oai_r, tgi_events, oai_events = asyncio.run(requests())
        assert bad_r.status_code == 424, bad_r.text
        err = bad_r.json()["error"]
        assert err["type"] == "server_error" and "could not compute" in err["message"], err
        assert "injected" not in err["message"] and "index" not in err["message"]
        assert tgi_r.status_code == 200, tgi_r.text
        assert oai_r.status_code == 200 and oai_r.json()["usage"]["completion_tokens"] == LONG
        events = list(sse_events(tgi_events))
        assert "error" not in events[-1] and events[-1]["details"]["generated_tokens"] == LONG
        assert oai_events[-1] == "data: [DONE]"
        chunks = list(sse_events(oai_events[:-1]))
        assert not [c for c in chunks if "error" in c], chunks[-1]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        _wait_for(lambda: _engine_is_clean(llm), "the engine to free every request")
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/ready").status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={**cmpl, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert _engine_is_clean(llm)


# ---- an engine thread that dies --------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_fails_open_requests_and_health_says_503(llm, monkeypatch):
    body = {"inputs": "hello", "parameters": {"max_new_tokens": LONG}}
    with server_thread(build_app(llm=llm)) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            with c.stream("POST", "/generate_stream", json=body) as r:
                events = sse_events(r.iter_lines())
                assert "token" in next(events)

                def broken_inbox() -> None:  # outside the step's guard: the thread dies
                    raise RuntimeError("injected: the engine loop broke")

                monkeypatch.setattr(llm, "_drain_inbox", broken_inbox)
                rest = list(events)  # must end, not hang on a dead thread
            assert rest and rest[-1]["error_type"] == "generation", rest[-3:]
            assert "engine loop broke" in rest[-1]["error"]
            _wait_for(lambda: not llm.is_running, "the engine thread to die")
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            assert c.get("/ready").status_code == 503
            r = c.post("/generate", json={"inputs": "hi"})
            assert r.status_code == 503 and r.json()["error_type"] == "unavailable", r.text
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert isinstance(llm.error, RuntimeError)
